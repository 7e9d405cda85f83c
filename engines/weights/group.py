"""Standalone torch.distributed groups for weight transfer: learner rank 0 plus every engine, nothing else.

The learner's default process group belongs to its data-parallel ranks, so the transfer group is a process
group OBJECT built directly on a store (`ProcessGroupGloo` / `ProcessGroupNCCL`), never registered globally.
The sender hosts one `TCPStore` for its lifetime; each group generation lives under its own key prefix, so
re-forming the group after an engine restarts is cheap (a new prefix and a handful of keys) and a late
member of an old generation can never confuse a new one.

Rendezvous, per generation: each receiver registers its name under its rank; the sender waits for all of them
and then publishes "go" (or "abort: <who is missing>", which the joined receivers read and raise); then all
members construct the process group and exchange one tiny broadcast so a dead member shows up at formation,
not in the middle of the first transfer.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

from engines.weights.base import WeightTransferError
from engines.weights.names import TORCH_DISTRIBUTED

Backend = Literal["gloo", "nccl", "cuda_ipc"]
KEY_ROOT = "slipstream/weights"
STATUS_GO = b"go"
ABORT_PREFIX = b"abort:"
OK = b"ok"  # a member's reply when all went well; otherwise ERROR_PREFIX and why
ERROR_PREFIX = b"error:"


@dataclass(frozen=True)
class GroupSpec:
    """Everything a member needs to join one generation; plain values so it can travel in a bus message."""

    host: str
    port: int
    generation: int
    members: tuple[str, ...]  # members[0] is the sender; rank = position
    backend: Backend = "gloo"

    def __post_init__(self) -> None:
        if len(self.members) < 2:
            raise ValueError(f"a transfer group needs the sender and at least one receiver, got {self.members}")
        if len(set(self.members)) != len(self.members):
            raise ValueError(f"transfer group member names must be unique, got {self.members}")
        if self.backend not in ("gloo", "nccl", "cuda_ipc"):
            raise ValueError(f"backend must be 'gloo', 'nccl' or 'cuda_ipc', got {self.backend!r}")

    @property
    def receivers(self) -> tuple[str, ...]:
        return self.members[1:]

    def rank_of(self, name: str) -> int:
        if name not in self.members:
            raise ValueError(
                f"{name!r} is not a member of transfer group generation {self.generation}: {self.members}"
            )
        return self.members.index(name)

    def to_dict(self) -> dict[str, Any]:
        """Carries the mechanism's name, by which a rollout worker picks the loader for it."""
        return {"transport": TORCH_DISTRIBUTED, **self.__dict__, "members": list(self.members)}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> GroupSpec:
        fields = {key: value for key, value in raw.items() if key != "transport"}
        return cls(**{**fields, "members": tuple(fields["members"])})


def generation_store(store: dist.Store, generation: int) -> dist.PrefixStore:
    return dist.PrefixStore(f"{KEY_ROOT}/gen{generation}/", store)


def host_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """The sender's store server; port 0 picks a free port (read it back from `.port`)."""
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))


def connect_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    try:
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistError) as error:
        raise WeightTransferError(f"cannot reach the weight-transfer store at {host}:{port}: {error}") from error


def missing_keys(store: dist.Store, keys: list[str], timeout_s: float) -> list[str]:
    """Wait up to `timeout_s` for all `keys`; return the ones still absent (empty list on success)."""
    if not keys:
        return []
    try:
        store.wait(keys, timedelta(seconds=max(timeout_s, 0.001)))
        return []
    except (RuntimeError, dist.DistError):
        return [key for key in keys if not store.check([key])]


def failed_replies(
    store: dist.Store, key_by_member: Mapping[str, str], timeout_s: float, *, expected: bytes, silent: str
) -> dict[str, str]:
    """Members whose reply key did not appear within `timeout_s` (reason `silent`) or holds something other than
    `expected` (the reason they wrote after ERROR_PREFIX); empty when every member answered as expected."""
    missing = set(missing_keys(store, list(key_by_member.values()), timeout_s))
    failed: dict[str, str] = {}
    for member, key in key_by_member.items():
        if key in missing:
            failed[member] = silent
            continue
        value = store.get(key)
        if value != expected:
            failed[member] = value.removeprefix(ERROR_PREFIX).decode(errors="replace").strip()
    return failed


def create_process_group(
    store: dist.Store, rank: int, size: int, backend: Backend, host: str, timeout_s: float
) -> dist.ProcessGroup:
    """Build the group object (blocks until all `size` members construct theirs, or raises on timeout)."""
    timeout = timedelta(seconds=timeout_s)
    pg_store = dist.PrefixStore("pg/", store)
    if backend == "cuda_ipc":
        from engines.weights.cuda_ipc import CudaIpcGroup

        return CudaIpcGroup(pg_store, rank, size, timeout_s)  # type: ignore[return-value]  # broadcast() alike
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise RuntimeError("backend 'nccl' requested but this torch build has no NCCL")
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = timeout
        return dist.ProcessGroupNCCL(pg_store, rank, size, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [_gloo_device(host)]
    return dist.ProcessGroupGloo(pg_store, rank, size, options)


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> dist.Work:
    """Asynchronous broadcast from rank 0 (the sender) on a standalone group object."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    return group.broadcast([tensor], options)


def transfer_device(backend: Backend, device: torch.device | str | None) -> torch.device:
    """Where buffers live: the CUDA device (current one by default) for NCCL and CUDA IPC, the CPU for gloo."""
    if device is not None:
        return torch.device(device)
    if backend in ("nccl", "cuda_ipc"):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gloo_device(host: str) -> Any:
    """A loopback store means every member is on this machine: bind gloo to loopback too, since the default
    (resolving the hostname) can pick an interface that is down or firewalled on laptops and CI runners."""
    if _is_loopback(host):
        return dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
    return dist.ProcessGroupGloo.create_default_device()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
