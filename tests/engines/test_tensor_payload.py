"""Tensors by reference for `/update_weights_from_tensor`: opened by another process, and nothing else opened."""

from __future__ import annotations

import base64
import io
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as torch_mp

from engines.sglang.tensor_payload import ALLOWED_GLOBALS, PayloadError, decode_named_tensors, encode_named_tensors

READER = """
import sys
from engines.sglang.tensor_payload import decode_named_tensors
for name, tensor in decode_named_tensors(sys.stdin.read()):
    print(name, str(tensor.dtype), list(tensor.shape), repr(tensor.double().sum().item()))
"""


def named() -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        ("layer.weight", torch.randn(8, 4, generator=generator).to(torch.bfloat16)),
        ("layer.bias", torch.randn(8, generator=generator)),
        ("empty", torch.empty(0)),
        ("steps", torch.arange(6)),
    ]


@pytest.mark.integration
def test_another_process_opens_the_tensors_by_name_not_by_our_file_descriptors() -> None:
    tensors = named()
    payload = encode_named_tensors(tensors)
    read = subprocess.run([sys.executable, "-c", READER], input=payload, capture_output=True, text=True,
                          timeout=60, check=True, cwd=os.getcwd())
    expected = [f"{n} {t.dtype} {list(t.shape)} {t.double().sum().item()!r}" for n, t in tensors]
    assert read.stdout.splitlines() == expected
    # Shared by name for these tensors only: the process's own sharing strategy is left as it was.
    assert torch_mp.get_sharing_strategy() == "file_descriptor"


@pytest.mark.unit
def test_a_payload_holds_no_global_beyond_the_allowed_ones() -> None:
    seen: list[tuple[str, str]] = []

    class Recording(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> object:
            seen.append((module, name))
            return super().find_class(module, name)

    Recording(io.BytesIO(base64.b64decode(encode_named_tensors(named())))).load()
    assert seen and set(seen) <= ALLOWED_GLOBALS


@pytest.mark.unit
def test_anything_else_is_refused_by_name() -> None:
    with pytest.raises(PayloadError, match=r"(posix|os)\.system is not allowed"):
        decode_named_tensors(base64.b64encode(pickle.dumps([("x", os.system)])))
    with pytest.raises(PayloadError, match="not base64"):
        decode_named_tensors("%%%")
    with pytest.raises(PayloadError, match="list of \\(name, tensor\\) pairs"):
        decode_named_tensors(base64.b64encode(pickle.dumps({"x": 1})))
    with pytest.raises(PayloadError, match="cannot open the tensors"):
        decode_named_tensors(base64.b64encode(base64.b64decode(encode_named_tensors(named()))[:-20]))


SHARER = """
import os, sys, torch
from engines.sglang.tensor_payload import encode_named_tensors
encode_named_tensors([("weight", torch.ones(4))])
print(os.getpid(), flush=True)
sys.stdin.readline()
"""


@pytest.mark.integration
def test_torchs_shared_memory_manager_does_not_hold_the_senders_output_open() -> None:
    """The manager torch starts at the first tensor shared by name outlives its last client by a grace of seconds:
    holding the sender's stdout or stderr, it kept whoever reads them (a launcher's caller) waiting for EOF."""
    sender = subprocess.Popen([sys.executable, "-c", SHARER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        line = sender.stdout.readline()
        assert line, sender.stderr.read()[-3000:]
        pid, proc = int(line), Path("/proc")
        children = [int(child) for task in (proc / str(pid) / "task").iterdir()
                    for child in (task / "children").read_text().split()]
        managers = [child for child in children if "torch_shm_manager" in (proc / str(child) / "cmdline").read_text()]
        assert managers, f"no torch_shm_manager among the sender's children {children}"
        outputs = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in (1, 2)}
        held = {os.readlink(f"/proc/{manager}/fd/{fd}") for manager in managers for fd in (0, 1, 2)
                if os.path.exists(f"/proc/{manager}/fd/{fd}")}
        assert not outputs & held, f"the manager holds the sender's output: {outputs & held}"
    finally:
        sender.communicate(input="\n", timeout=60)
    assert sender.returncode == 0
