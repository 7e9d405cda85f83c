"""Weight transfer through shared staging buffers, for receivers that can read the sender's memory directly.

When every engine can map memory the learner wrote (the same GPU through CUDA IPC, `cuda_ipc.py`; the same host
through a shared-memory file, `shared_memory.py`), nothing has to be broadcast. The learner copies each bucket
into one of two staging buffers, announces it in the rendezvous store, and every receiver copies it straight
from that buffer into its own tensor. A receiver's "done" tells the learner the slot may be reused, which keeps
at most two buckets in flight, like the broadcast path.

A group stands where a process group stands in `torch_distributed.py`: it offers the one call that module makes,
`broadcast([tensor], options)`, with the same meaning (rank 0's bytes end up in everyone's tensor), so the
manifest, readiness, acknowledgement and failure protocol are shared with the broadcast transports unchanged.
Every wait on the store has the group's deadline; a receiver that stops answering fails the transfer, naming
nothing worse than a timeout, and the learner's own tensors are only ever read. A mechanism supplies how a
buffer is made, shared and opened (`_allocate`, `_open`) and when a copy is complete (`_synchronise`).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
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


class StagedCopyGroup(ABC):
    """Rank 0 (the sender) shares staging buffers; ranks 1..size-1 copy from them. One instance per member."""

    transport = "staged copy"  # the mechanism's name, in errors

    def __init__(self, store: dist.Store, rank: int, size: int, timeout_s: float) -> None:
        self._check_support()
        self.store, self.rank, self.size = store, rank, size
        self.timeout = timedelta(seconds=timeout_s)
        self._message = 0
        self._slots: list[Tensor | None] = [None] * STAGING_SLOTS
        self._slot_keys: list[str] = [""] * STAGING_SLOTS
        self._allocations = 0
        self._opened: dict[str, Tensor] = {}  # receiver: allocation key -> the sender's staging buffer

    # -- what a mechanism provides ---------------------------------------------------------------------------------

    def _check_support(self) -> None:  # noqa: B027 - most mechanisms run anywhere
        """Raise if this process cannot take part (no CUDA for CUDA IPC)."""

    @abstractmethod
    def _check_tensor(self, tensor: Tensor) -> None:
        """Raise if `tensor` lives where this mechanism cannot move it from or to."""

    @abstractmethod
    def _allocate(self, key: str, nbytes: int) -> tuple[Tensor, list[bytes]]:
        """A new staging buffer of `nbytes` and, for each receiver rank 1..size-1, the handle it opens it by."""

    @abstractmethod
    def _open(self, handle: bytes) -> Tensor:
        """The sender's staging buffer, as a uint8 tensor, from the handle `_allocate` gave this rank."""

    def _synchronise(self, tensor: Tensor) -> None:  # noqa: B027 - a CPU copy is complete when it returns
        """Block until copies into or out of `tensor` have completed."""

    def _retire(self, key: str) -> None:  # noqa: B027 - most buffers go when their last reference does
        """The sender replaced the buffer of allocation `key`."""

    def close(self) -> None:  # noqa: B027
        """Release what the group holds outside the process (the sender's shared files)."""

    # -- the protocol ----------------------------------------------------------------------------------------------

    def broadcast(self, tensors: list[Tensor], options: Any = None) -> _Done:
        (tensor,) = tensors
        self._check_tensor(tensor)
        message, self._message = self._message, self._message + 1
        flat = tensor.detach().reshape(-1).view(torch.uint8)
        if self.rank == 0:
            self._publish(message, flat)
        else:
            self._copy_in(message, flat)
        return _Done()

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
        self._synchronise(buffer)
        announcement = {"allocation": self._slot_keys[slot], "nbytes": flat.numel()}
        self.store.set(f"bucket/{message}", json.dumps(announcement).encode())

    def _share(self, slot: int, nbytes: int) -> Tensor:
        if self._slot_keys[slot]:
            self._retire(self._slot_keys[slot])
        self._allocations += 1
        key = self._slot_keys[slot] = f"{slot}.{self._allocations}"
        buffer, handles = self._allocate(key, nbytes)
        self._slots[slot] = buffer
        for rank, handle in enumerate(handles, start=1):
            self.store.set(f"handle/{key}/{rank}", handle)
        return buffer

    def _copy_in(self, message: int, flat: Tensor) -> None:
        self._wait([f"bucket/{message}"])
        announcement = json.loads(self.store.get(f"bucket/{message}"))
        key, nbytes = announcement["allocation"], int(announcement["nbytes"])
        if nbytes != flat.numel():
            raise RuntimeError(
                f"{self.transport} bucket {message}: the sender sent {nbytes} bytes, the receiver expects "
                f"{flat.numel()}"
            )
        source = self._opened.get(key)
        if source is None:
            self._wait([f"handle/{key}/{self.rank}"])
            source = self._open(self.store.get(f"handle/{key}/{self.rank}"))
            self._opened = {k: v for k, v in self._opened.items() if k.split(".")[0] != key.split(".")[0]}
            self._opened[key] = source
        flat.copy_(source[:nbytes])
        self._synchronise(flat)
        self.store.set(f"done/{message}/{self.rank}", b"1")

    def _wait(self, keys: list[str]) -> None:
        try:
            self.store.wait(keys, self.timeout)
        except (RuntimeError, dist.DistError) as error:
            missing = [key for key in keys if not self.store.check([key])]
            raise RuntimeError(
                f"{self.transport} transfer: rank {self.rank} waited {self.timeout.total_seconds():g}s for "
                f"{missing}: {error}"
            ) from error
