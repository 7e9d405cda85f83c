"""Same-GPU weight transfer: CUDA IPC buffers in place of an NCCL broadcast.

NCCL refuses a communicator with two ranks on one device, so when the engines share the learner's GPU (one GPU
for everything, or `--colocate`: see `actors/launch/placement.py`) the bytes cannot be broadcast. They do not
need to be: the staging protocol of `staged_copy.py` runs over buffers shared once per receiver through CUDA IPC,
and every receiver copies each bucket straight from the learner's buffer into its own tensor (a device-to-device
copy, no host round trip).

Handles travel as JSON (bytes as hex) and are opened with torch's own IPC rebuild; nothing is unpickled. The
receiver finds the device by its UUID, so two processes whose CUDA_VISIBLE_DEVICES number it differently still
meet on the same GPU, and a receiver on another GPU gets an error that says so.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import Tensor

from engines.weights.staged_copy import StagedCopyGroup


class CudaIpcGroup(StagedCopyGroup):
    """Rank 0 (the sender) shares staging buffers; ranks 1..size-1 copy from them. One instance per member."""

    transport = "cuda_ipc"

    def _check_support(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("the cuda_ipc weight transport needs CUDA in every member's process")

    def _check_tensor(self, tensor: Tensor) -> None:
        if tensor.device.type != "cuda":
            raise RuntimeError(f"cuda_ipc broadcast of a {tensor.device} tensor; the transport moves CUDA tensors")

    def _allocate(self, key: str, nbytes: int) -> tuple[Tensor, list[bytes]]:
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", torch.cuda.current_device()))
        uuid = str(torch.cuda.get_device_properties(buffer.device).uuid)
        # One share per receiver: each share carries its own reference count, released when that receiver drops
        # the buffer, so the memory outlives neither too short nor forever.
        handles = [json.dumps(_encode_handle(uuid, buffer.untyped_storage()._share_cuda_())).encode()
                   for _ in range(1, self.size)]
        return buffer, handles

    def _open(self, handle: bytes) -> Tensor:
        return _open_handle(json.loads(handle))

    def _synchronise(self, tensor: Tensor) -> None:
        torch.cuda.current_stream(tensor.device).synchronize()


def _encode_handle(uuid: str, handle: tuple[Any, ...]) -> dict[str, Any]:
    device, ipc, size, offset, counter, counter_offset, event, event_sync = handle
    return {
        "uuid": uuid,
        "device": int(device),
        "ipc": ipc.hex(),
        "size": int(size),
        "offset": int(offset),
        "counter": counter.hex(),
        "counter_offset": int(counter_offset),
        "event": event.hex() if event else "",
        "event_sync": bool(event_sync),
    }


def _open_handle(raw: dict[str, Any]) -> Tensor:
    device = local_device_of(raw["uuid"])
    storage = torch.UntypedStorage._new_shared_cuda(
        device,
        bytes.fromhex(raw["ipc"]),
        raw["size"],
        raw["offset"],
        bytes.fromhex(raw["counter"]),
        raw["counter_offset"],
        bytes.fromhex(raw["event"]) if raw["event"] else None,
        raw["event_sync"],
    )
    empty = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", device))
    return empty.set_(storage, 0, (raw["size"],), (1,))


def local_device_of(uuid: str) -> int:
    """This process's index of the GPU with `uuid`; an error naming the GPUs seen if it is not visible here."""
    seen = {str(torch.cuda.get_device_properties(index).uuid): index for index in range(torch.cuda.device_count())}
    if uuid not in seen:
        raise RuntimeError(
            f"cuda_ipc weight transport: the learner's GPU {uuid} is not visible to this process (it sees "
            f"{sorted(seen) or 'no GPU'}); same-device transfer needs the engine on the learner's GPU"
        )
    return seen[uuid]
