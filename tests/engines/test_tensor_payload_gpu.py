"""A colocated SGLang server's weight update on a GPU: CUDA tensors by reference, opened by another process.

SGLang itself does not fit on the lent GPU machines (its wheels are far over what a call may carry), so this
checks our half of `/update_weights_from_tensor` on a real GPU: the payload names the device by UUID, as SGLang's
patched rebuild resolves it, and a separate process (our compatible server's reader) opens the learner's memory
and sees its values without a copy through the host.
"""

from __future__ import annotations

import base64
import io
import pickle
import subprocess
import sys

import pytest
import torch

from engines.sglang.tensor_payload import encode_named_tensors

READER = """
import sys, torch
from engines.sglang.tensor_payload import decode_named_tensors
for name, tensor in decode_named_tensors(sys.stdin.read()):
    print(name, tensor.device.type, repr(tensor.double().sum().item()))
"""


@pytest.mark.gpu
def test_cuda_tensors_travel_as_handles_that_name_the_gpu_by_uuid() -> None:
    tensors = [("w", torch.randn(64, 32, device="cuda").to(torch.bfloat16)), ("b", torch.randn(64, device="cuda"))]
    payload = encode_named_tensors(tensors)
    devices: list[object] = []

    class Recording(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> object:
            if name == "rebuild_cuda_tensor":
                return lambda *args: devices.append(args[6])
            return super().find_class(module, name)

    Recording(io.BytesIO(base64.b64decode(payload))).load()
    assert devices == [str(torch.cuda.get_device_properties(0).uuid)] * 2

    read = subprocess.run([sys.executable, "-c", READER], input=payload, capture_output=True, text=True, timeout=120)
    assert read.returncode == 0, read.stderr[-2000:]
    expected = [f"{name} cuda {tensor.double().sum().item()!r}" for name, tensor in tensors]
    assert read.stdout.splitlines() == expected
