"""Tensors by reference, in the form SGLang's `/update_weights_from_tensor` reads: a pickle of `[(name, tensor)]`.

A colocated server shares the learner's device (or host), so a weight update does not move bytes through a
socket: the learner pickles each tensor as a handle to its own memory and the server copies from it. SGLang reads
`serialized_named_tensors[tp_rank]` with its restricted unpickler (`MultiprocessingSerializer.deserialize`) and
accepts only the globals of torch's shared-memory rebuild functions and tensor types, base64-encoded over HTTP.

How each tensor is pickled:
* CUDA: torch's own IPC reduction (`rebuild_cuda_tensor`), with the device index replaced by the GPU's UUID, the
  form SGLang's patched rebuild resolves in its own numbering (two processes may number one GPU differently).
* CPU: the storage moves into a named shared-memory segment (torch's "file_system" sharing, done here for these
  tensors only, whatever the process-wide strategy), so a process that is not our child can open it by name.
  The default "file_descriptor" sharing would need our `multiprocessing` authentication key.

The sender must keep each tensor alive until the server acknowledged the call that carried it.
`decode_named_tensors` is our compatible server's reader, restricted to the globals this encoder writes, all of
which both supported SGLang releases allow (`tests/engines/test_sglang_contract.py` checks that).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import pickle
import sys
import threading
from collections.abc import Iterable
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # registers torch's reductions with ForkingPickler
from torch import Tensor
from torch.multiprocessing import reductions

_DEVICE_ARG = 6  # position of the device index among `rebuild_cuda_tensor`'s arguments (SGLang patches the same)


class PayloadError(ValueError):
    """A payload that is not a list of (name, tensor) pairs this reader may open; the message says why."""


def encode_named_tensors(named: Iterable[tuple[str, Tensor]]) -> str:
    """Base64 text of a pickle of `[(name, tensor), ...]` whose tensors are handles to this process's memory."""
    buffer = io.BytesIO()
    _HandlePickler(buffer).dump([(str(name), tensor) for name, tensor in named])
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_named_tensors(payload: str | bytes) -> list[tuple[str, Tensor]]:
    """The tensors of an `encode_named_tensors` payload, opened in this process (shared, not copied)."""
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as error:
        raise PayloadError(f"serialized_named_tensors: not base64 ({error})") from error
    try:
        named = _HandleUnpickler(io.BytesIO(raw)).load()
    except PayloadError:
        raise
    except Exception as error:  # a truncated pickle, a segment already gone, a GPU not visible here
        reason = f"{type(error).__name__}: {error}"
        raise PayloadError(f"serialized_named_tensors: cannot open the tensors ({reason})") from error
    if not isinstance(named, list) or not all(
        isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], Tensor)
        for item in named
    ):
        raise PayloadError("serialized_named_tensors: expected a list of (name, tensor) pairs")
    return named


# ---- writing --------------------------------------------------------------------------------------------------


def shareable_buffer(nbytes: int, device: torch.device) -> Tensor:
    """A uint8 buffer whose views pickle as handles another process opens: on a CPU it lives in one named
    shared-memory segment from the start, so a view pickles without moving anything (and a reader maps the
    segment, not a fresh copy); on a GPU any allocation can be shared over CUDA IPC."""
    buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
    if device.type == "cpu":
        start_shm_manager_off_our_output()
        buffer.untyped_storage()._share_filename_cpu_()
    return buffer


_manager = threading.Lock()
_manager_started = False


def start_shm_manager_off_our_output() -> None:
    """torch starts its shared-memory manager (`torch_shm_manager`) at a process's first storage shared by name,
    and the manager inherits the process's stderr. It outlives its last client by a shutdown grace of seconds, so
    whoever reads our output to its end (a shell pipe, a caller of the launcher, whose actors share its stderr) waits
    for the manager as well. Started here, once, with its stderr on /dev/null: it writes there only its own fatal
    errors, which reach us anyway as a share that fails. Another thread's stderr in the few milliseconds of the
    manager's start is lost with it."""
    global _manager_started
    with _manager:
        if _manager_started:
            return
        if sys.stderr is not None:
            sys.stderr.flush()
        try:
            ours = os.dup(2)
        except OSError:  # no stderr to keep the manager off
            ours = None
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, 2)
            torch.empty(1).untyped_storage()._share_filename_cpu_()  # the manager starts with this share
        finally:
            if ours is not None:
                os.dup2(ours, 2)
                os.close(ours)
            os.close(devnull)
        _manager_started = True


class _HandlePickler(ForkingPickler):
    """torch's reductions, with CPU storages shared by name and CUDA devices named by UUID."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self.dispatch_table[torch.UntypedStorage] = _storage_by_name
        for tensor_class in (torch.Tensor, torch.nn.Parameter):
            self.dispatch_table[tensor_class] = _tensor_with_device_uuid


def _storage_by_name(storage: torch.UntypedStorage) -> tuple[Any, tuple[Any, ...]]:
    if storage.size() == 0:  # an empty storage cannot be mapped
        return reductions.rebuild_storage_empty, (type(storage),)
    start_shm_manager_off_our_output()
    manager, handle, size = storage._share_filename_cpu_()
    storage._shared_incref()  # the reader's rebuild takes this reference over
    return reductions.rebuild_storage_filename, (type(storage), manager, handle, size)


def _tensor_with_device_uuid(tensor: Tensor) -> tuple[Any, tuple[Any, ...]]:
    rebuild, args = reductions.reduce_tensor(tensor)
    if tensor.device.type != "cuda":
        return rebuild, args
    args = list(args)
    args[_DEVICE_ARG] = str(torch.cuda.get_device_properties(args[_DEVICE_ARG]).uuid)
    return rebuild, tuple(args)


# ---- reading --------------------------------------------------------------------------------------------------

_REDUCTIONS = "torch.multiprocessing.reductions"
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    ("torch", "Tensor"), ("torch", "Size"), ("torch", "UntypedStorage"), ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
    ("torch.nn.parameter", "Parameter"), ("torch._utils", "_rebuild_tensor_v2"),
    (_REDUCTIONS, "rebuild_tensor"), (_REDUCTIONS, "rebuild_cuda_tensor"), (_REDUCTIONS, "rebuild_typed_storage"),
    (_REDUCTIONS, "rebuild_storage_filename"), (_REDUCTIONS, "rebuild_storage_empty"),
    *(("torch", name) for name in ("float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2",
                                   "int64", "int32", "int16", "int8", "uint8", "bool")),
})  # fmt: skip


class _HandleUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED_GLOBALS:
            raise PayloadError(f"serialized_named_tensors: {module}.{name} is not allowed in a tensor payload")
        if (module, name) == (_REDUCTIONS, "rebuild_cuda_tensor"):
            return _rebuild_cuda_tensor_by_uuid
        return super().find_class(module, name)


def _rebuild_cuda_tensor_by_uuid(*args: Any) -> Tensor:
    from engines.weights.cuda_ipc import local_device_of

    args_list = list(args)
    if isinstance(args_list[_DEVICE_ARG], str):
        args_list[_DEVICE_ARG] = local_device_of(args_list[_DEVICE_ARG])
    return reductions.rebuild_cuda_tensor(*args_list)
