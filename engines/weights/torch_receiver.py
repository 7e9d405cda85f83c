"""The engine's end of the bucketed torch.distributed broadcast; the protocol is described, and the sender
implemented, in `torch_distributed.py`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from torch import Tensor

from engines.weights import group as groups
from engines.weights.base import LoadFn, WeightReceiver, WeightTransferError
from engines.weights.fingerprint import FingerprintPlan, ServedPrints
from engines.weights.held import InPlace, ReceiverCopy
from engines.weights.manifest import Bucket, Manifest, TensorSpec, bucket_views

OK, ERROR_PREFIX = groups.OK, groups.ERROR_PREFIX
FingerprintFn = Callable[[tuple[TensorSpec, ...], FingerprintPlan], ServedPrints | None]
"""The engine's fingerprints of what it serves for the pushed tensors, with the sender's algorithm."""


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
        self._copy = ReceiverCopy(device)  # what a delta applies to (`held.py`), while the sender asks to keep one

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
        given_up = groups.aborted(keys)
        if given_up is not None:  # an order that arrived late, for a generation the sender already left
            raise WeightTransferError(f"{name}: generation {spec.generation} was given up by the sender: {given_up}")
        if keys.add(f"join_count/{rank}", 1) > 1:
            raise WeightTransferError(f"{name!r} already joined generation {spec.generation}", {name: "joined twice"})
        keys.set(f"joined/{rank}", name.encode())
        if groups.missing_keys(keys, ["status"], timeout_s, stop=lambda: keys.check([groups.ABORTED])):
            given_up = groups.aborted(keys)
            if given_up is not None:
                raise WeightTransferError(f"{name}: generation {spec.generation} aborted by the sender: {given_up}")
            raise WeightTransferError(f"{name}: sender did not start generation {spec.generation} in {timeout_s:g}s")
        status = keys.get("status")
        if status != groups.STATUS_GO:
            reason = status.removeprefix(groups.ABORT_PREFIX).decode(errors="replace").strip()
            raise WeightTransferError(f"{name}: generation {spec.generation} aborted by the sender: {reason}")

        process_group = cls._form_group(spec, name, rank, keys, transfer_device, timeout_s)
        return cls(spec, name, rank, store, process_group, transfer_device, timeout_s)

    @classmethod
    def _form_group(cls, spec: groups.GroupSpec, name: str, rank: int, keys: dist.PrefixStore,
                    transfer_device: torch.device, timeout_s: float) -> dist.ProcessGroup:
        """The sender said go: build this member's end of the process group the buckets travel over."""

        # The sender's ABORTED mark ends both waits: a member that died meanwhile is not coming.
        def sender_gave_up() -> str | None:
            return groups.aborted(keys)

        formed = False
        try:
            process_group = groups.create_process_group(
                keys, rank, len(spec.members), spec.backend, spec.host, timeout_s, given_up=sender_gave_up
            )
            probe = torch.zeros(1, device=transfer_device)
            work = groups.broadcast(process_group, probe)
            formed = groups.wait_work(work, lambda: keys.check([groups.ABORTED]))
            if not formed:
                groups.park(process_group, [work], [probe])
        except (RuntimeError, dist.DistError) as error:
            if sender_gave_up() is None:
                raise WeightTransferError(f"{name}: process group formation failed: {error}") from error
        if not formed:
            raise WeightTransferError(
                f"{name}: generation {spec.generation} aborted by the sender while forming: {sender_gave_up()}"
            )
        return process_group

    def receive(
        self,
        load_fn: LoadFn,
        timeout: float,
        *,
        destinations: Mapping[str, Tensor] | None = None,
        finish_fn: Callable[[int], None] | None = None,
        fingerprint_fn: FingerprintFn | None = None,
        in_place: InPlace | None = None,
    ) -> int:
        """Raises TimeoutError if no transfer starts within `timeout`; WeightTransferError if one fails.

        `destinations` (optional: the engine's live tensors by name) lets a tensor that travels alone land in
        place with no staging copy when its dtype, shape and device match; `load_fn` gets everything else.
        `finish_fn(version)`, when given, runs after the last bucket loaded and before the acknowledgement, so
        an engine that puts the version to use only once it has all of it (an adapter loaded from a folder)
        acknowledges "served", not "received"; what it raises is reported like a `load_fn` failure.
        `fingerprint_fn(specs, plan)`, when given and the sender asks for fingerprints, then fingerprints what
        the engine serves (`fingerprint.py`); they reach the sender before the acknowledgement. Without it the
        sender reports this engine as one it could not check.
        `in_place(name)`, when given, is the engine's live tensor a delta push may write into (`held.py`); a delta
        that goes wholly in place still ends with one `load_fn` call of no tensors, so the engine takes the version.
        A sender that dies (its store with it) fails the receive as a WeightTransferError too, not as the store's
        network error: that is a failed transfer the caller reports in one line, not a bug.
        """
        try:
            return self._receive(load_fn, timeout, destinations=destinations, finish_fn=finish_fn,
                                 fingerprint_fn=fingerprint_fn, in_place=in_place)
        except dist.DistNetworkError as error:
            self._group = None
            raise WeightTransferError(f"{self.name}: the sender's store went away ({error}): the learner died or "
                                      "left; nothing of this transfer is applied") from error

    def _receive(
        self,
        load_fn: LoadFn,
        timeout: float,
        *,
        destinations: Mapping[str, Tensor] | None,
        finish_fn: Callable[[int], None] | None,
        fingerprint_fn: FingerprintFn | None,
        in_place: InPlace | None,
    ) -> int:
        if self._group is None:
            raise WeightTransferError(f"{self.name}: receiver of generation {self.spec.generation} is closed/broken")
        prefix = f"xfer/{self._sequence}/"
        if groups.missing_keys(self._keys, [prefix + "manifest"], timeout, stop=self._given_up):
            self._raise_if_given_up("before the transfer started")
            raise TimeoutError(f"{self.name}: no weight transfer started within {timeout:g}s")
        try:
            manifest = Manifest.decode(self._keys.get(prefix + "manifest"))
        except ValueError as error:  # never ready: the sender names us and aborts the transfer for everyone
            self._group = None
            raise WeightTransferError(f"{self.name}: unreadable manifest: {error}") from error
        self._keys.set(f"{prefix}ready/{self.rank}", b"1")
        # Longer than the sender waits for readiness (same timeout, doubled), so its verdict on a missing peer
        # arrives before this receiver gives up.
        if groups.missing_keys(self._keys, [prefix + "go"], 2 * self._timeout_s, stop=self._given_up):
            self._raise_if_given_up(f"before version {manifest.version} started")
            self._group = None
            raise WeightTransferError(f"{self.name}: sender never started transfer of version {manifest.version}")
        go = self._keys.get(prefix + "go")
        if go != groups.STATUS_GO:
            self._group = None
            reason = go.removeprefix(groups.ABORT_PREFIX).decode(errors="replace").strip()
            raise WeightTransferError(f"{self.name}: transfer of version {manifest.version} aborted: {reason}")
        # A kept copy is filled through load_fn: no bucket lands straight in the engine's tensors then.
        load = self._copy.load_fn(manifest, load_fn, in_place)
        destinations = {} if manifest.keep else destinations
        try:
            with groups.single_threaded_copies(self._device):
                load_error = self._receive_buckets(manifest.wire(), load, destinations or {})
        except (RuntimeError, dist.DistError) as error:
            self._keys.set(f"{prefix}ack/{self.rank}", ERROR_PREFIX + f" broadcast failed: {error}".encode())
            raise WeightTransferError(f"{self.name}: transfer of version {manifest.version} broke: {error}") from error
        if self._group is None:  # the sender gave the generation up mid-way; our pending receives are parked
            self._keys.set(f"{prefix}ack/{self.rank}", ERROR_PREFIX + b" left: the sender gave the generation up")
            self._raise_if_given_up(f"during version {manifest.version}")
        if load_error is None:
            try:
                self._copy.finish(manifest, load_fn)
                if finish_fn is not None:
                    finish_fn(manifest.version)
            except Exception as error:  # reported in the ack, like a load_fn failure; the group stays usable
                load_error = f"{type(error).__name__}: {error}"
        self._copy.settle(manifest, loaded=load_error is None and self._group is not None)
        served = _served(fingerprint_fn, manifest) if load_error is None and fingerprint_fn is not None else None
        if served is not None:
            self._keys.set(f"{prefix}prints/{self.rank}", served.encode())
        ack = OK if load_error is None else ERROR_PREFIX + f" load_fn failed: {load_error}".encode()
        self._keys.set(f"{prefix}ack/{self.rank}", ack)
        self._sequence += 1
        if load_error is not None:
            raise WeightTransferError(f"{self.name}: load_fn failed on version {manifest.version}: {load_error}")
        return manifest.version

    def close(self) -> None:
        groups.abort_nccl(self._group)
        self._group, self._buffers = None, []

    # -- internals --------------------------------------------------------------------------------------------

    def _given_up(self) -> bool:
        return self._keys.check([groups.ABORTED])

    def _raise_if_given_up(self, when: str) -> None:
        reason = groups.aborted(self._keys)
        if reason is not None:
            self._group = None
            raise WeightTransferError(
                f"{self.name}: generation {self.spec.generation} given up by the sender {when}: {reason}"
            )

    def _wait(self, work: dist.Work) -> bool:
        if self.spec.backend == "nccl":
            work.wait()
            return True
        return groups.wait_work(work, self._given_up)

    def _receive_buckets(self, manifest: Manifest, load_fn: LoadFn, destinations: Mapping[str, Tensor]) -> str | None:
        """Receive every bucket (always all of them, to keep the collective whole); return load_fn's error.

        If the sender gives the generation up meanwhile, or a receive fails, the group is let go of with the
        receives still pending on it (`group.park`; `self._group` is None on return or raise)."""
        buckets = manifest.buckets()
        targets = [self._direct_target(manifest, bucket, destinations) for bucket in buckets]
        staged = max((b.nbytes for b, t in zip(buckets, targets, strict=True) if t is None), default=0)
        slots = [groups.slot_buffer(self._buffers, slot, staged, self._device) for slot in range(groups.IN_FLIGHT)]
        pending: dict[int, dist.Work] = {}

        def post(position: int) -> None:
            if position < len(buckets) and buckets[position].nbytes:
                payload = targets[position]
                if payload is None:
                    payload = slots[position % groups.IN_FLIGHT][: buckets[position].nbytes]
                pending[position] = groups.broadcast(self._group, payload)

        def let_go() -> None:
            groups.park(self._group, list(pending.values()), [*self._buffers, *targets])
            groups.abort_nccl(self._group)  # receives pending on a sender that gave up: the watchdog's otherwise
            self._group, self._buffers = None, []

        load_error: str | None = None
        try:
            for position in range(min(groups.IN_FLIGHT - 1, len(buckets))):
                post(position)
            for position, bucket in enumerate(buckets):
                post(position + groups.IN_FLIGHT - 1)
                if position in pending and not self._wait(pending[position]):
                    let_go()
                    return load_error
                pending.pop(position, None)
                if load_error is None and targets[position] is None:
                    try:
                        load_fn(bucket_views(slots[position % groups.IN_FLIGHT], manifest.tensors, bucket))
                    except Exception as error:  # any engine failure: the collective must still complete
                        load_error = f"{type(error).__name__}: {error}"
        except (RuntimeError, dist.DistError):
            let_go()
            raise
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        return load_error

    def _direct_target(self, manifest: Manifest, bucket: Bucket, destinations: Mapping[str, Tensor]) -> Tensor | None:
        """The engine's own tensor as raw bytes, when a lone tensor can be received straight into it."""
        if len(bucket.entries) != 1 or not destinations:
            return None
        spec = manifest.tensors[bucket.entries[0][0]]
        destination = destinations.get(spec.name)
        if destination is None or tuple(destination.shape) != spec.shape:
            return None
        return groups.own_bytes(destination, spec.dtype, self._device)


def _served(fingerprint_fn: FingerprintFn, manifest: Manifest) -> ServedPrints | None:
    """The engine's fingerprints (None: not asked for, or an engine that cannot tell); if fingerprinting fails,
    every tensor unchecked with the reason: the weights did load, so this is a verdict, not a failed transfer."""
    plan = manifest.fingerprint_plan()
    if plan is None:
        return None
    started = time.perf_counter()
    try:
        served = fingerprint_fn(manifest.tensors, plan)
    except Exception as error:
        reason = f"fingerprinting failed: {type(error).__name__}: {error}"[:300]
        return ServedPrints(unchecked={spec.name: reason for spec in manifest.tensors})
    if served is not None:  # what the engine's answer took, beside its generation (`torch_loader.py`)
        served.seconds = time.perf_counter() - started
    return served
