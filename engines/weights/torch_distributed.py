"""Bucketed weight broadcast over a standalone torch.distributed group (gloo on CPU, NCCL on GPU).

One transfer, keyed by its sequence number inside the group generation:

1. The sender publishes the manifest (names, dtypes, shapes, version, bucket layout) in the store.
2. Each receiver reads it and says "ready"; the sender waits for every receiver (naming the missing ones and
   telling the others to abort), then says "go". A receiver that died since the last transfer is therefore
   caught before a single byte moves, and the group stays well-defined for everyone else.
3. Buckets are broadcast as raw bytes, two in flight: the sender packs bucket i+1 while bucket i is on the
   wire, and each receiver posts the receive of bucket i+1 before handing bucket i to `load_fn`. Small tensors
   share buckets; a large one travels alone, straight from the sender's tensor (when no cast is needed) and,
   if the receiver passed `destinations`, straight into the engine's live tensor: no copy on either end.
4. Each receiver acknowledges after its last `load_fn` returned ("ok" or the error), and only when every ack
   is "ok" does the sender commit the version.

A receiver whose `load_fn` raises keeps receiving the remaining buckets (so the collective completes and the
group stays usable), then reports the error in its ack. A broken collective (a member died mid-transfer)
breaks the generation: both ends raise and the learner forms a new generation.

CPU note: gloo moves bytes on its own threads. Torch's OpenMP workers, which keep spinning for a while after
each parallel copy, starve those threads on small machines (measured: half the throughput on 2 cores), so on
the CPU the packing and loading copies run with one intra-op thread for the duration of a transfer.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from engines.weights import group as groups
from engines.weights.base import LoadFn, TransferReport, WeightReceiver, WeightSender, WeightTransferError
from engines.weights.manifest import Bucket, Manifest, TensorSpec

# Measured with tools/bench_weights.py on gloo: each collective costs ~0.5 ms whatever its size, so tensors under
# 1 MiB are coalesced; buckets of 32 MiB keep the packing of the first bucket and the unpacking of the last
# (the only copies the two-deep pipeline cannot hide) short; 256 MiB buckets were ~25% slower on fp32 weights.
DEFAULT_BUCKET_BYTES = 32 * 1024 * 1024
DEFAULT_DIRECT_BYTES = 1024 * 1024
IN_FLIGHT = 2
OK, ERROR_PREFIX = groups.OK, groups.ERROR_PREFIX


class TorchDistributedWeightSender(WeightSender):
    """Learner rank 0's end. Hosts the rendezvous store and forms one group generation at a time.

    Usage: `spec = sender.open_group(["learner", "engine-0", ...])`; hand `spec` to the engines (they call
    `TorchDistributedWeightReceiver.join(spec, name)`); `sender.wait_for_receivers()`; then `send(...)` per
    version. After a `WeightTransferError` from a broken group, call `open_group` again with the live members.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        backend: groups.Backend = "gloo",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        direct_bytes: int = DEFAULT_DIRECT_BYTES,
        timeout_s: float = 120.0,
        device: torch.device | str | None = None,
    ) -> None:
        if bucket_bytes <= 0 or direct_bytes <= 0:
            raise ValueError(f"bucket_bytes and direct_bytes must be positive, got {bucket_bytes}, {direct_bytes}")
        self._host, self._backend, self._timeout_s = host, backend, timeout_s
        # Public and changeable between transfers: each manifest carries the layout it was sent with.
        self.bucket_bytes, self.direct_bytes = bucket_bytes, direct_bytes
        self._device = groups.transfer_device(backend, device)
        self._store = groups.host_store(host, port, timeout_s)
        self._generation = -1
        self._spec: groups.GroupSpec | None = None
        self._keys: dist.PrefixStore | None = None
        self._group: dist.ProcessGroup | None = None
        self._broken: str | None = None
        self._sequence = 0
        self._committed: int | None = None
        self._buffers: list[Tensor] = []

    @property
    def port(self) -> int:
        return self._store.port

    @property
    def committed_version(self) -> int | None:
        return self._committed

    def open_group(self, members: Sequence[str]) -> groups.GroupSpec:
        """Start a new generation (dropping the current one) and return the spec the receivers must join."""
        self.close_group()
        self._generation += 1
        self._spec = groups.GroupSpec(self._host, self.port, self._generation, tuple(members), self._backend)
        self._keys = groups.generation_store(self._store, self._generation)
        self._broken, self._sequence = None, 0
        return self._spec

    def wait_for_receivers(self, timeout_s: float | None = None) -> None:
        """Block until every receiver of the open generation joined; raise naming those that did not."""
        spec, keys = self._require_spec()
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        joined = [f"joined/{rank}" for rank in range(1, len(spec.members))]
        missing = groups.missing_keys(keys, joined, timeout_s)
        if missing:
            absent = {spec.members[int(key.split("/")[1])]: f"never joined within {timeout_s:g}s" for key in missing}
            keys.set("status", groups.ABORT_PREFIX + f" never joined: {', '.join(absent)}".encode())
            self._broken = "formation aborted"
            raise WeightTransferError(f"weight-transfer group generation {spec.generation} not formed", absent)
        keys.set("status", groups.STATUS_GO)
        try:
            self._group = groups.create_process_group(
                keys, 0, len(spec.members), spec.backend, spec.host, self._timeout_s
            )
            groups.broadcast(self._group, torch.zeros(1, device=self._device)).wait()
        except (RuntimeError, dist.DistError) as error:
            self._broken = f"formation failed: {error}"
            raise WeightTransferError(
                f"weight-transfer group generation {spec.generation}: process group formation failed: {error}"
            ) from error

    def send(
        self,
        named_tensors: Iterable[tuple[str, Tensor]],
        version: int,
        *,
        dtype: torch.dtype | None = None,
        timeout_s: float | None = None,
    ) -> TransferReport:
        """Broadcast the tensors (floating ones cast to `dtype` on the way, if given) and commit `version`.

        `timeout_s` (default: the sender's) bounds the wait for every receiver to be ready and to acknowledge.
        The tensors are read, never modified or retained; they must not change until this returns.

        One pass over `named_tensors`, keeping references only: the manifest (every name, dtype and shape) must
        reach the receivers before the first byte, so it is built from the tensors the iterator yields, then
        the buckets are cast and packed one at a time. Nothing is copied whole: a trainer that yields its live
        parameters costs no memory here, one that gathers shards (Megatron) holds its gathered tensors once.
        """
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        spec, keys = self._require_spec()
        if self._group is None or self._broken is not None:
            raise WeightTransferError(
                f"weight-transfer group generation {spec.generation} is not usable "
                f"({self._broken or 'wait_for_receivers() not called'}); call open_group() again"
            )
        started = time.perf_counter()
        tensors = [(name, tensor.detach()) for name, tensor in named_tensors]  # views: nothing is copied
        manifest = _manifest(tensors, version, self.bucket_bytes, self.direct_bytes, dtype)
        prefix = f"xfer/{self._sequence}/"
        receivers = spec.receivers
        keys.set(prefix + "manifest", manifest.encode())
        missing = groups.missing_keys(
            keys, [f"{prefix}ready/{rank}" for rank in range(1, len(spec.members))], timeout_s
        )
        if missing:
            failed = {
                spec.members[int(key.rsplit("/", 1)[1])]: "not ready to receive (died or stalled)" for key in missing
            }
            keys.set(prefix + "go", groups.ABORT_PREFIX + f" not ready: {', '.join(failed)}".encode())
            self._broken = f"receivers {sorted(failed)} missing at transfer {self._sequence}"
            raise WeightTransferError(f"weight transfer of version {version} not started", failed)
        keys.set(prefix + "go", groups.STATUS_GO)
        buckets = manifest.buckets()
        try:
            with _single_threaded_copies(self._device):
                self._broadcast_buckets(tensors, manifest, buckets)
        except (RuntimeError, dist.DistError) as error:
            self._broken = f"broadcast failed: {error}"
            failed = self._collect_acks(spec, prefix, min(timeout_s, 5.0))
            failed = failed or dict.fromkeys(receivers, "unknown")
            raise WeightTransferError(
                f"weight transfer of version {version} broke mid-way: {error}", failed
            ) from error
        failed = self._collect_acks(spec, prefix, timeout_s)
        self._clear_keys(keys, prefix, len(spec.members))
        self._sequence += 1
        if failed:
            raise WeightTransferError(f"weight transfer of version {version} not committed", failed)
        self._committed = version
        return TransferReport(
            version=version,
            receivers=receivers,
            num_tensors=len(tensors),
            num_buckets=len(buckets),
            num_bytes=manifest.total_bytes,
            seconds=time.perf_counter() - started,
        )

    def close_group(self) -> None:
        self._group, self._buffers = None, []
        self._spec, self._keys = None, None

    def close(self) -> None:
        self.close_group()

    # -- internals --------------------------------------------------------------------------------------------

    def _require_spec(self) -> tuple[groups.GroupSpec, dist.PrefixStore]:
        if self._spec is None or self._keys is None:
            raise WeightTransferError("no weight-transfer group is open; call open_group() first")
        return self._spec, self._keys

    def _broadcast_buckets(self, tensors: list[tuple[str, Tensor]], manifest: Manifest, buckets: list[Bucket]) -> None:
        """At most IN_FLIGHT broadcasts outstanding; a packing slot is rewritten only after its last send ended."""
        in_flight: deque[dist.Work] = deque()
        slot_work: list[dist.Work | None] = [None] * IN_FLIGHT
        next_slot = 0
        for bucket in buckets:
            if bucket.nbytes == 0:
                continue
            while len(in_flight) >= IN_FLIGHT:
                in_flight.popleft().wait()
            payload, slot = self._direct_payload(tensors, manifest, bucket), None
            if payload is None:
                slot, next_slot = next_slot, (next_slot + 1) % IN_FLIGHT
                if slot_work[slot] is not None:
                    slot_work[slot].wait()
                payload = self._buffer(slot, bucket.nbytes)
                for index, offset in bucket.entries:
                    _view(payload, offset, manifest.tensors[index]).copy_(tensors[index][1])
            work = groups.broadcast(self._group, payload)
            if slot is not None:
                slot_work[slot] = work
            in_flight.append(work)
        while in_flight:
            in_flight.popleft().wait()

    def _direct_payload(self, tensors: list[tuple[str, Tensor]], manifest: Manifest, bucket: Bucket) -> Tensor | None:
        """The tensor's own bytes when a bucket is one tensor already in wire form (no cast, no copy)."""
        if len(bucket.entries) != 1:
            return None
        index, _ = bucket.entries[0]
        tensor = tensors[index][1]
        if (
            tensor.dtype != manifest.tensors[index].dtype
            or tensor.device != self._device
            or not tensor.is_contiguous()
        ):
            return None
        return tensor.detach().reshape(-1).view(torch.uint8)

    def _buffer(self, slot: int, nbytes: int) -> Tensor:
        while len(self._buffers) <= slot:
            self._buffers.append(torch.empty(0, dtype=torch.uint8, device=self._device))
        if self._buffers[slot].numel() < nbytes:
            self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        return self._buffers[slot][:nbytes]

    def _collect_acks(self, spec: groups.GroupSpec, prefix: str, timeout_s: float) -> dict[str, str]:
        keys = {spec.members[rank]: f"{prefix}ack/{rank}" for rank in range(1, len(spec.members))}
        return groups.failed_replies(self._keys, keys, timeout_s, expected=OK,
                                     silent=f"no acknowledgement within {timeout_s:g}s (died or stalled)")

    @staticmethod
    def _clear_keys(keys: dist.PrefixStore, prefix: str, size: int) -> None:
        for key in ("manifest", "go", *(f"ready/{r}" for r in range(1, size)), *(f"ack/{r}" for r in range(1, size))):
            keys.delete_key(prefix + key)


class TorchDistributedWeightReceiver(WeightReceiver):
    """An engine's end of one group generation. Create it with `join`; a new generation needs a new receiver."""

    def __init__(
        self,
        spec: groups.GroupSpec,
        name: str,
        rank: int,
        store: dist.TCPStore,
        process_group: dist.ProcessGroup,
        device: torch.device,
        timeout_s: float,
    ) -> None:
        self.spec, self.name, self.rank = spec, name, rank
        self._store = store
        self._keys = groups.generation_store(store, spec.generation)
        self._group: dist.ProcessGroup | None = process_group
        self._device = device
        self._timeout_s = timeout_s
        self._sequence = 0
        self._buffers: list[Tensor] = []

    @classmethod
    def join(
        cls,
        spec: groups.GroupSpec,
        name: str,
        *,
        timeout_s: float = 120.0,
        device: torch.device | str | None = None,
    ) -> TorchDistributedWeightReceiver:
        """Register as `name`, wait for the sender's go, and build the process group (all blocking)."""
        rank = spec.rank_of(name)
        if rank == 0:
            raise ValueError(f"{name!r} is the sender (members[0]) of generation {spec.generation}, not a receiver")
        transfer_device = groups.transfer_device(spec.backend, device)
        store = groups.connect_store(spec.host, spec.port, timeout_s)
        keys = groups.generation_store(store, spec.generation)
        if keys.add(f"join_count/{rank}", 1) > 1:
            raise WeightTransferError(f"{name!r} already joined generation {spec.generation}", {name: "joined twice"})
        keys.set(f"joined/{rank}", name.encode())
        if groups.missing_keys(keys, ["status"], timeout_s):
            raise WeightTransferError(f"{name}: sender did not start generation {spec.generation} in {timeout_s:g}s")
        status = keys.get("status")
        if status != groups.STATUS_GO:
            reason = status.removeprefix(groups.ABORT_PREFIX).decode(errors="replace").strip()
            raise WeightTransferError(f"{name}: generation {spec.generation} aborted by the sender: {reason}")
        try:
            process_group = groups.create_process_group(
                keys, rank, len(spec.members), spec.backend, spec.host, timeout_s
            )
            groups.broadcast(process_group, torch.zeros(1, device=transfer_device)).wait()
        except (RuntimeError, dist.DistError) as error:
            raise WeightTransferError(f"{name}: process group formation failed: {error}") from error
        return cls(spec, name, rank, store, process_group, transfer_device, timeout_s)

    def receive(self, load_fn: LoadFn, timeout: float, *, destinations: Mapping[str, Tensor] | None = None) -> int:
        """Raises TimeoutError if no transfer starts within `timeout`; WeightTransferError if one fails.

        `destinations` (optional: the engine's live tensors by name) lets a tensor that travels alone land in
        place with no staging copy when its dtype, shape and device match; `load_fn` gets everything else.
        """
        if self._group is None:
            raise WeightTransferError(f"{self.name}: receiver of generation {self.spec.generation} is closed/broken")
        prefix = f"xfer/{self._sequence}/"
        if groups.missing_keys(self._keys, [prefix + "manifest"], timeout):
            raise TimeoutError(f"{self.name}: no weight transfer started within {timeout:g}s")
        try:
            manifest = Manifest.decode(self._keys.get(prefix + "manifest"))
        except ValueError as error:  # never ready: the sender names us and aborts the transfer for everyone
            self._group = None
            raise WeightTransferError(f"{self.name}: unreadable manifest: {error}") from error
        self._keys.set(f"{prefix}ready/{self.rank}", b"1")
        # Longer than the sender waits for readiness (same timeout, doubled), so its verdict on a missing peer
        # arrives before this receiver gives up.
        if groups.missing_keys(self._keys, [prefix + "go"], 2 * self._timeout_s):
            self._group = None
            raise WeightTransferError(f"{self.name}: sender never started transfer of version {manifest.version}")
        go = self._keys.get(prefix + "go")
        if go != groups.STATUS_GO:
            self._group = None
            reason = go.removeprefix(groups.ABORT_PREFIX).decode(errors="replace").strip()
            raise WeightTransferError(f"{self.name}: transfer of version {manifest.version} aborted: {reason}")
        try:
            with _single_threaded_copies(self._device):
                load_error = self._receive_buckets(manifest, load_fn, destinations or {})
        except (RuntimeError, dist.DistError) as error:
            self._group = None
            self._keys.set(f"{prefix}ack/{self.rank}", ERROR_PREFIX + f" broadcast failed: {error}".encode())
            raise WeightTransferError(f"{self.name}: transfer of version {manifest.version} broke: {error}") from error
        ack = OK if load_error is None else ERROR_PREFIX + f" load_fn failed: {load_error}".encode()
        self._keys.set(f"{prefix}ack/{self.rank}", ack)
        self._sequence += 1
        if load_error is not None:
            raise WeightTransferError(f"{self.name}: load_fn failed on version {manifest.version}: {load_error}")
        return manifest.version

    def close(self) -> None:
        self._group, self._buffers = None, []

    # -- internals --------------------------------------------------------------------------------------------

    def _receive_buckets(self, manifest: Manifest, load_fn: LoadFn, destinations: Mapping[str, Tensor]) -> str | None:
        """Receive every bucket (always all of them, to keep the collective whole); return load_fn's error."""
        buckets = manifest.buckets()
        targets = [self._direct_target(manifest, bucket, destinations) for bucket in buckets]
        staged = max((b.nbytes for b, t in zip(buckets, targets, strict=True) if t is None), default=0)
        slots = [self._buffer(slot, staged) for slot in range(IN_FLIGHT)]
        pending: dict[int, dist.Work] = {}

        def post(position: int) -> None:
            if position < len(buckets) and buckets[position].nbytes:
                payload = targets[position]
                if payload is None:
                    payload = slots[position % IN_FLIGHT][: buckets[position].nbytes]
                pending[position] = groups.broadcast(self._group, payload)

        load_error: str | None = None
        for position in range(min(IN_FLIGHT - 1, len(buckets))):
            post(position)
        for position, bucket in enumerate(buckets):
            post(position + IN_FLIGHT - 1)
            if position in pending:
                pending.pop(position).wait()
            if load_error is None and targets[position] is None:
                try:
                    load_fn(_bucket_views(slots[position % IN_FLIGHT], manifest.tensors, bucket))
                except Exception as error:  # any engine failure: the collective must still complete
                    load_error = f"{type(error).__name__}: {error}"
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        return load_error

    def _direct_target(self, manifest: Manifest, bucket: Bucket, destinations: Mapping[str, Tensor]) -> Tensor | None:
        """The engine's own tensor as raw bytes, when a lone tensor can be received straight into it."""
        if len(bucket.entries) != 1 or not destinations:
            return None
        spec = manifest.tensors[bucket.entries[0][0]]
        destination = destinations.get(spec.name)
        if (
            destination is None
            or destination.dtype != spec.dtype
            or tuple(destination.shape) != spec.shape
            or destination.device != self._device
            or not destination.is_contiguous()
        ):
            return None
        return destination.detach().reshape(-1).view(torch.uint8)

    def _buffer(self, slot: int, nbytes: int) -> Tensor:
        while len(self._buffers) <= slot:
            self._buffers.append(torch.empty(0, dtype=torch.uint8, device=self._device))
        if self._buffers[slot].numel() < nbytes:
            self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        return self._buffers[slot]


@contextlib.contextmanager
def _single_threaded_copies(device: torch.device) -> Iterator[None]:
    """See the module docstring's CPU note. A no-op for CUDA transfers."""
    if device.type != "cpu":
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _manifest(
    tensors: list[tuple[str, Tensor]],
    version: int,
    bucket_bytes: int,
    direct_bytes: int,
    dtype: torch.dtype | None,
) -> Manifest:
    names = [name for name, _ in tensors]
    if len(set(names)) != len(names):
        duplicate = next(name for name in names if names.count(name) > 1)
        raise ValueError(f"weight transfer: tensor name {duplicate!r} appears twice")
    specs = tuple(
        TensorSpec(
            name,
            dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype,
            tuple(tensor.shape),
        )
        for name, tensor in tensors
    )
    return Manifest(version=version, bucket_bytes=bucket_bytes, direct_bytes=direct_bytes, tensors=specs)


def _view(buffer: Tensor, offset: int, spec: TensorSpec) -> Tensor:
    return buffer[offset : offset + spec.nbytes].view(spec.dtype).view(spec.shape)


def _bucket_views(buffer: Tensor, specs: tuple[TensorSpec, ...], bucket: Bucket) -> Iterator[tuple[str, Tensor]]:
    for index, offset in bucket.entries:
        spec = specs[index]
        yield spec.name, _view(buffer, offset, spec)
