"""Same-GPU weight transfer: CUDA IPC buffers in place of an NCCL broadcast.

NCCL refuses a communicator with two ranks on one device, so when the engines share the learner's GPU (one GPU
for everything: see `actors/runtime/placement.py`) the bytes cannot be broadcast. They do not need to be: the learner
copies each bucket into one of two staging buffers it shares once per receiver through CUDA IPC, announces it
in the rendezvous store, and every receiver copies it straight from that buffer into its own tensor (a
device-to-device copy, no host round trip). A receiver's "done" tells the learner the staging slot may be
reused, which keeps at most two buckets in flight, like the broadcast path.

`CudaIpcGroup` stands where a process group stands in `torch_distributed.py`: it offers the one call that module
makes, `broadcast([tensor], options)`, with the same meaning (rank 0's bytes end up in everyone's tensor), so the
manifest, readiness, acknowledgement and failure protocol are shared with the broadcast transports unchanged.
Every wait on the store has the group's deadline; a receiver that stops answering fails the transfer, naming
nothing worse than a timeout, and the learner's own tensors are only ever read.

Handles travel as JSON (bytes as hex) and are opened with torch's own IPC rebuild; nothing is unpickled. The
receiver finds the device by its UUID, so two processes whose CUDA_VISIBLE_DEVICES number it differently still
meet on the same GPU, and a receiver on another GPU gets an error that says so.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

STAGING_SLOTS = 2


class _Done:
    """A completed `Work`: the copy already happened when `broadcast` returned."""

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True


class CudaIpcGroup:
    """Rank 0 (the sender) shares staging buffers; ranks 1..size-1 copy from them. One instance per member."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout_s: float) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("the cuda_ipc weight transport needs CUDA in every member's process")
        self.store, self.rank, self.size = store, rank, size
        self.timeout = timedelta(seconds=timeout_s)
        self._message = 0
        self._slots: list[Tensor | None] = [None] * STAGING_SLOTS
        self._slot_keys: list[str] = [""] * STAGING_SLOTS
        self._allocations = 0
        self._opened: dict[str, Tensor] = {}  # receiver: allocation key -> the sender's staging buffer

    def broadcast(self, tensors: list[Tensor], options: Any = None) -> _Done:
        (tensor,) = tensors
        if tensor.device.type != "cuda":
            raise RuntimeError(f"cuda_ipc broadcast of a {tensor.device} tensor; the transport moves CUDA tensors")
        message, self._message = self._message, self._message + 1
        flat = tensor.detach().reshape(-1).view(torch.uint8)
        if self.rank == 0:
            self._publish(message, flat)
        else:
            self._copy_in(message, flat)
        return _Done()

    # -- sender ---------------------------------------------------------------------------------------------------

    def _publish(self, message: int, flat: Tensor) -> None:
        slot = message % STAGING_SLOTS
        if message >= STAGING_SLOTS:  # the slot's previous bucket must have been read by every receiver
            previous = message - STAGING_SLOTS
            done = [f"done/{previous}/{rank}" for rank in range(1, self.size)]
            self._wait(done)
            for key in (f"bucket/{previous}", *done):
                self.store.delete_key(key)
        buffer = self._slots[slot]
        if buffer is None or buffer.numel() < flat.numel():
            buffer = self._share(slot, max(flat.numel(), 1))
        buffer[: flat.numel()].copy_(flat)
        torch.cuda.current_stream(buffer.device).synchronize()
        announcement = {"allocation": self._slot_keys[slot], "nbytes": flat.numel()}
        self.store.set(f"bucket/{message}", json.dumps(announcement).encode())

    def _share(self, slot: int, nbytes: int) -> Tensor:
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", torch.cuda.current_device()))
        self._slots[slot] = buffer
        self._allocations += 1
        key = self._slot_keys[slot] = f"{slot}.{self._allocations}"
        uuid = str(torch.cuda.get_device_properties(buffer.device).uuid)
        for rank in range(1, self.size):
            # One share per receiver: each share carries its own reference count, released when that receiver
            # drops the buffer, so the memory outlives neither too short nor forever.
            handle = buffer.untyped_storage()._share_cuda_()
            self.store.set(f"handle/{key}/{rank}", json.dumps(_encode_handle(uuid, handle)).encode())
        return buffer

    # -- receiver -------------------------------------------------------------------------------------------------

    def _copy_in(self, message: int, flat: Tensor) -> None:
        self._wait([f"bucket/{message}"])
        announcement = json.loads(self.store.get(f"bucket/{message}"))
        key, nbytes = announcement["allocation"], int(announcement["nbytes"])
        if nbytes != flat.numel():
            raise RuntimeError(
                f"cuda_ipc bucket {message}: the sender sent {nbytes} bytes, the receiver expects {flat.numel()}"
            )
        source = self._opened.get(key)
        if source is None:
            self._wait([f"handle/{key}/{self.rank}"])
            source = _open_handle(json.loads(self.store.get(f"handle/{key}/{self.rank}")))
            self._opened = {k: v for k, v in self._opened.items() if k.split(".")[0] != key.split(".")[0]}
            self._opened[key] = source
        flat.copy_(source[:nbytes])
        torch.cuda.current_stream(flat.device).synchronize()
        self.store.set(f"done/{message}/{self.rank}", b"1")

    def _wait(self, keys: list[str]) -> None:
        try:
            self.store.wait(keys, self.timeout)
        except (RuntimeError, dist.DistError) as error:
            missing = [key for key in keys if not self.store.check([key])]
            raise RuntimeError(
                f"cuda_ipc transfer: rank {self.rank} waited {self.timeout.total_seconds():g}s for {missing}: {error}"
            ) from error


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
