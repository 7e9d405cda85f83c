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

A generation the sender gives up on (a member died, or it moved on to the next generation) gets an "aborted"
key; every wait on either side polls for it beside what it waits for, so nobody sits out a timeout for a process
that is gone.

Everything listens on the configured address only: the store's server socket is bound here and handed to torch
(which would otherwise listen on every interface), and gloo binds the sender to that address and each receiver to
its own address on the route to it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

from engines.weights.base import WeightTransferError
from engines.weights.interruptible_store import POLL_S, InterruptibleStore, poll_keys
from engines.weights.names import TORCH_DISTRIBUTED

Backend = Literal["gloo", "nccl", "cuda_ipc", "shm", "disk"]
KEY_ROOT = "slipstream/weights"
STATUS_GO = b"go"
ABORT_PREFIX = b"abort:"
OK = b"ok"  # a member's reply when all went well; otherwise ERROR_PREFIX and why
ERROR_PREFIX = b"error:"
ABORTED = "aborted"  # per generation: set (to the reason) once the sender gave the generation up
IN_FLIGHT = 2  # broadcasts outstanding at once, on both ends: one on the wire while the next is packed/posted


@dataclass(frozen=True)
class GroupSpec:
    """Everything a member needs to join one generation; plain values so it can travel in a bus message."""

    host: str
    port: int
    generation: int
    members: tuple[str, ...]  # members[0] is the sender; rank = position
    backend: Backend = "gloo"
    # The mechanism whose loader the engines build for it: this broadcast also carries mechanisms of their own,
    # which differ in what the engine does with the tensors (an SGLang server loads a LoRA adapter from them).
    transport: str = TORCH_DISTRIBUTED
    # backend "disk": the folder the sender writes each push into and the receivers read it from (`disk.py`)
    directory: str | None = None
    local_directory: str | None = None  # ... and where each receiver copies a push before reading it, if anywhere

    def __post_init__(self) -> None:
        if len(self.members) < 2:
            raise ValueError(f"a transfer group needs the sender and at least one receiver, got {self.members}")
        if len(set(self.members)) != len(self.members):
            raise ValueError(f"transfer group member names must be unique, got {self.members}")
        if self.backend not in ("gloo", "nccl", "cuda_ipc", "shm", "disk"):
            raise ValueError(f"backend must be 'gloo', 'nccl', 'cuda_ipc', 'shm' or 'disk', got {self.backend!r}")
        if (self.backend == "disk") != (self.directory is not None):
            raise ValueError(f"a group spec names a directory exactly when its backend is 'disk', got backend "
                             f"{self.backend!r} with directory {self.directory!r}")

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
        return {**self.__dict__, "members": list(self.members)}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> GroupSpec:
        return cls(**{**raw, "members": tuple(raw["members"])})


def generation_store(store: dist.Store, generation: int) -> dist.PrefixStore:
    return dist.PrefixStore(f"{KEY_ROOT}/gen{generation}/", store)


def host_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """The sender's store server, listening on `host` only; port 0 picks a free port (read it back from `.port`).

    Torch binds its server to every interface; given a socket already bound (`master_listen_fd`), it serves on
    that one, and owns it from then on (it closes the socket when the store goes)."""
    listener = _listening_socket(host, port)
    try:
        store = dist.TCPStore(
            host,
            listener.getsockname()[1],
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
            master_listen_fd=listener.fileno(),
        )
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns it now
    return store


def connect_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    try:
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistError) as error:
        raise WeightTransferError(f"cannot reach the weight-transfer store at {host}:{port}: {error}") from error


def missing_keys(
    store: dist.Store, keys: list[str], timeout_s: float, *, stop: Callable[[], bool] | None = None
) -> list[str]:
    """Wait up to `timeout_s` for all `keys`; return the ones still absent (empty list on success).

    With `stop`, the store is polled (at most POLL_S apart) and the wait ends early, returning what is still
    missing, as soon as `stop()` is true: the caller tells a timeout from a stop by asking `stop()` again."""
    if not keys:
        return []
    if stop is None:
        try:
            store.wait(keys, timedelta(seconds=max(timeout_s, 0.001)))
            return []
        except (RuntimeError, dist.DistError):
            return [key for key in keys if not store.check([key])]
    if poll_keys(store, keys, timeout_s, stop):
        return []
    return [key for key in keys if not store.check([key])]


def aborted(store: dist.Store) -> str | None:
    """Why the sender gave this generation up (`store` is the generation's), or None while it stands."""
    if not store.check([ABORTED]):
        return None
    return store.get(ABORTED).decode(errors="replace")


def wait_work(work: dist.Work, stop: Callable[[], bool]) -> bool:
    """Wait for a collective; True once it completed, False (still pending) as soon as `stop()` is true.

    A gloo collective waits for a dead peer until the group's timeout, and cannot be cancelled; waiting in
    slices lets the caller give up on it (see `park`). A failed collective raises its error.

    A slice that times out just as the collective completes raises "Operation timed out!" for a collective that
    is done: its own outcome then decides (a second wait returns at once, or raises the collective's error).
    Re-raising the slice's timeout failed a healthy transfer every few hundred slices (3 receivers, 2 cores)."""
    while True:
        try:
            work.wait(timedelta(seconds=POLL_S))
            return True
        except (RuntimeError, dist.DistError):
            if work.is_completed():
                work.wait()
                return True
        if stop():
            return False


def park(group: Any, pending: list[dist.Work], keep: list[Any]) -> None:
    """Let go of a process group whose collectives are still pending on a peer that will never take part.

    Gloo can neither cancel them nor destroy the group meanwhile (destruction blocks until they end), and they
    read or write the tensors in `keep` until then: a daemon thread holds all of it until the collectives ended
    (the group's timeout at worst) and drops it there, so no caller ever blocks on it."""
    threading.Thread(target=_hold, args=(group, pending, keep), name="weights-parked-group", daemon=True).start()


def _hold(group: Any, pending: list[dist.Work], keep: list[Any]) -> None:
    for work in pending:
        with contextlib.suppress(Exception):  # the group was abandoned: its collectives are expected to fail
            work.wait()


def failed_replies(
    store: dist.Store,
    key_by_member: Mapping[str, str],
    timeout_s: float,
    *,
    expected: bytes,
    silent: str,
    stop: Callable[[], bool] | None = None,
) -> dict[str, str]:
    """Members whose reply key did not appear within `timeout_s` (reason `silent`) or holds something other than
    `expected` (the reason they wrote after ERROR_PREFIX); empty when every member answered as expected. `stop`
    as for `missing_keys` (the members still silent then count as failed)."""
    missing = set(missing_keys(store, list(key_by_member.values()), timeout_s, stop=stop))
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
    store: dist.Store, rank: int, size: int, backend: Backend, host: str, timeout_s: float,
    *, given_up: Callable[[], str | None] | None = None,
) -> dist.ProcessGroup:
    """Build the group object (blocks until all `size` members construct theirs, or raises on timeout).

    `host` is the store's, that is the sender's (rank 0's) address: gloo listens there on the sender, and on each
    receiver at the receiver's own address on the route to it. `given_up` (a reason once the generation is given
    up, else None) ends gloo's wait for a member that died before constructing its group, with `GroupGivenUp`."""
    timeout = timedelta(seconds=timeout_s)
    pg_store = dist.PrefixStore("pg/", store)
    if backend == "cuda_ipc":
        from engines.weights.cuda_ipc import CudaIpcGroup

        return CudaIpcGroup(pg_store, rank, size, timeout_s)  # type: ignore[return-value]  # broadcast() alike
    if backend == "shm":
        from engines.weights.shared_memory import SharedMemoryGroup

        return SharedMemoryGroup(pg_store, rank, size, timeout_s)  # type: ignore[return-value]
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise RuntimeError("backend 'nccl' requested but this torch build has no NCCL")
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = timedelta(seconds=collective_timeout_s(timeout_s))
        return dist.ProcessGroupNCCL(pg_store, rank, size, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [_gloo_device(host if rank == 0 else local_address_towards(host))]
    rendezvous = pg_store if given_up is None else InterruptibleStore(pg_store, given_up)
    return dist.ProcessGroupGloo(rendezvous, rank, size, options)


def collective_timeout_s(timeout_s: float) -> float:
    """A weight group's own timeout for a collective, well past every wait of ours (`timeout_s` each). NCCL's
    waits do not block the host, so a bucket pending on a dead peer shows only as a missing acknowledgement; when
    the group timeout runs out first, the watchdog ends the process (TORCH_NCCL_ASYNC_ERROR_HANDLING's default),
    and the learner with it. Ours run out first, and the group is aborted (`abort_nccl`). Both senders use it:
    the torch engine's for NCCL, SGLang's for every backend."""
    return 2 * timeout_s + 60


def abort_nccl(group: object) -> None:
    """Abort an NCCL communicator being let go of: a collective still pending on a peer that will never take part
    then ends now, instead of at the group timeout with this process. Anything else is left as it is (gloo work
    pending is parked: `park`)."""
    if dist.is_nccl_available() and isinstance(group, dist.ProcessGroupNCCL):
        abort = getattr(group, "abort", None)  # a method of every torch release we allow, but not a documented one
        if abort is not None:
            with contextlib.suppress(RuntimeError, dist.DistError):
                abort()


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> dist.Work:
    """Asynchronous broadcast from rank 0 (the sender) on a standalone group object."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    return group.broadcast([tensor], options)


def slot_buffer(buffers: list[torch.Tensor], slot: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """Byte buffer number `slot` (of IN_FLIGHT) that one end of the group reuses for every bucket of every
    transfer, grown to hold at least `nbytes` (never shrunk: the largest bucket sizes it once)."""
    while len(buffers) <= slot:
        buffers.append(torch.empty(0, dtype=torch.uint8, device=device))
    if buffers[slot].numel() < nbytes:
        buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return buffers[slot]


def own_bytes(tensor: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """The tensor's own memory as bytes when it is already in wire form (`dtype`, on the transfer `device`,
    contiguous), so a bucket of that one tensor is broadcast from it or received into it with no staging copy."""
    if tensor.dtype != dtype or tensor.device != device or not tensor.is_contiguous():
        return None
    return tensor.detach().reshape(-1).view(torch.uint8)


def transfer_device(backend: Backend, device: torch.device | str | None) -> torch.device:
    """Where buffers live: the CUDA device (current one by default) for NCCL and CUDA IPC, the CPU for gloo."""
    if device is not None:
        return torch.device(device)
    if backend in ("nccl", "cuda_ipc"):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextlib.contextmanager
def single_threaded_copies(device: torch.device) -> Iterator[None]:
    """One intra-op thread for the packing and loading copies of a CPU transfer; a no-op for CUDA ones.

    Gloo moves bytes on its own threads, and torch's OpenMP workers, which keep spinning for a while after each
    parallel copy, starve them on small machines (measured: half the throughput on 2 cores)."""
    if device.type != "cpu":
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def local_address_towards(host: str) -> str:
    """This machine's address on the route to `host` (asked of the kernel; no packet is sent)."""
    if _is_loopback(host) or _is_wildcard(host):
        return host
    family, _, _, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return str(probe.getsockname()[0])


def _listening_socket(host: str, port: int) -> socket.socket:
    family, kind, protocol, _, address = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    listener = socket.socket(family, kind, protocol)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(socket.SOMAXCONN)
    except OSError as error:
        listener.close()
        raise WeightTransferError(f"cannot listen for the weight-transfer store on {host}:{port}: {error}") from error
    return listener


def _gloo_device(address: str) -> Any:
    """Gloo listens on `address` (a wildcard: wherever the hostname resolves, gloo's default). A loopback store
    means every member is on this machine, so loopback it is, never an interface resolved from the hostname, which
    can be down or firewalled on laptops and CI runners."""
    if _is_loopback(address):
        return dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
    if _is_wildcard(address):
        return dist.ProcessGroupGloo.create_default_device()
    return dist.ProcessGroupGloo.create_device(hostname=address)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _is_wildcard(host: str) -> bool:
    try:
        return not host or ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def interface_of(address: str) -> str | None:
    """The name of this machine's network interface that holds the IPv4 `address` (None if none does).

    A process group that `init_process_group` builds takes gloo's default device, found from the hostname, which
    on a multi-homed node or in a container may not be the address the other nodes reach: naming the interface
    in GLOO_SOCKET_IFNAME is the only say a caller has there."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(probe.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this one
                continue
            if socket.inet_ntoa(answer[20:24]) == address:
                return name
    return None
