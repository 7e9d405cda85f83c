"""Bucketed weight broadcast over a standalone torch.distributed group (gloo on CPU, NCCL on GPU): the protocol,
and the sender (learner rank 0); the receiver is in `torch_receiver.py`, the group and store in `group.py`.

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

With `delta_sync`, a push after a committed one may be a delta (`held.py`, `delta.py`): the manifest then says,
per tensor, its encoding and how many elements changed, and what travels in step 3 is each tensor's encoded bytes,
bucketed the same way (`Manifest.wire`).

A receiver whose `load_fn` raises keeps receiving the remaining buckets (so the collective completes and the
group stays usable), then reports the error in its ack. A broken collective (a member died mid-transfer)
breaks the generation: both ends raise and the learner forms a new generation.

A member's death is often known to the learner (its roster) before any collective fails: gloo waits for a dead
peer until the group's timeout. `abort()` gives the generation up from another thread; the sender's waits end
within a poll interval, it marks the generation aborted in the store, and every receiver's waits (for keys or
for a collective) end as soon as they see that mark. A collective still pending then is parked, never waited for.

On the CPU the packing and loading copies run with one intra-op thread (`group.single_threaded_copies`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import islice

import torch
import torch.distributed as dist
from torch import Tensor

from engines.weights import group as groups
from engines.weights.base import TransferReport, WeightsDiffer, WeightSender, WeightTransferError, require_usable
from engines.weights.fingerprint import Fingerprints, ServedPrints, algorithm_for, check_served
from engines.weights.held import DEFAULT_ANCHOR_EVERY, DEFAULT_BACKOFF, SenderCopy
from engines.weights.manifest import Bucket, Manifest, tensor_view
from engines.weights.stream import SourceBroke, specified, wire_specs

# Measured with tools/bench/weights.py on gloo: each collective costs ~0.5 ms whatever its size, so tensors under
# 1 MiB are coalesced; buckets of 32 MiB keep the packing of the first bucket and the unpacking of the last
# (the only copies the two-deep pipeline cannot hide) short; 256 MiB buckets were ~25% slower on fp32 weights.
DEFAULT_BUCKET_BYTES = 32 * 1024 * 1024
DEFAULT_DIRECT_BYTES = 1024 * 1024
BROKEN_ACKS_S = 1.0  # after a broadcast broke, how long the sender waits for the receivers to say why
OK, ERROR_PREFIX = groups.OK, groups.ERROR_PREFIX


class TorchDistributedWeightSender(WeightSender):
    """Learner rank 0's end. Hosts the rendezvous store and forms one group generation at a time.

    Usage: `spec = sender.open_group(["learner", "engine-0", ...])`; hand `spec` to the engines (they call
    `TorchDistributedWeightReceiver.join(spec, name)`); `sender.wait_for_receivers()`; then `send(...)` per
    version. After a `WeightTransferError` from a broken group, call `open_group` again with the live members.
    `abort(...)`, from any thread, gives the open generation up at once (a member is known to be gone).
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
        transport: str = groups.TORCH_DISTRIBUTED,
        fingerprint_stride: int = 1,
        delta_sync: bool = False,
        anchor_every: int = DEFAULT_ANCHOR_EVERY,
        delta_backoff: int = DEFAULT_BACKOFF,
    ) -> None:
        """`fingerprint_stride`: a checked push fingerprints one of that many slices of each tensor's rows, and of
        an adapter's layers (`FingerprintPlan`). `delta_sync`: after a full push, a push sends only what changed
        since the version the engines hold, with a full one every `anchor_every` versions and on any doubt, and
        `delta_backoff` full ones after a delta that was slower than a full push (`held.py`); it costs a copy of
        the pushed weights here and on each engine."""
        if bucket_bytes <= 0 or direct_bytes <= 0:
            raise ValueError(f"bucket_bytes and direct_bytes must be positive, got {bucket_bytes}, {direct_bytes}")
        if fingerprint_stride < 1:
            raise ValueError(f"fingerprint_stride must be >= 1, got {fingerprint_stride}")
        self._host, self._backend, self._timeout_s = host, backend, timeout_s
        self._transport = transport  # the name the group specs carry, so engines build the matching loader
        # Public and changeable between transfers: each manifest carries the layout it was sent with.
        self.bucket_bytes, self.direct_bytes = bucket_bytes, direct_bytes
        self.fingerprint_stride = fingerprint_stride
        self._device = groups.transfer_device(backend, device)
        self._store = groups.host_store(host, port, timeout_s)
        self._generation = -1
        self._spec: groups.GroupSpec | None = None
        self._keys: dist.PrefixStore | None = None
        self._group: dist.ProcessGroup | None = None
        self._broken: str | None = None
        self._aborted: dict[str, str] | None = None  # set by abort(), from any thread
        self._awaited: dict[str, str] = {}  # member -> the key the call under way waits for (see waiting_on)
        self._sequence = 0
        self._committed: int | None = None
        self._buffers: list[Tensor] = []
        self.delta_sync = delta_sync  # public and changeable between transfers, like the bucket sizes
        self._copy = SenderCopy(self._device, anchor_every=anchor_every, backoff=delta_backoff)

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
        self._spec = groups.GroupSpec(
            self._host, self.port, self._generation, tuple(members), self._backend, self._transport,
            **self._spec_extras()
        )
        self._keys = groups.generation_store(self._store, self._generation)
        self._broken, self._aborted, self._sequence = None, None, 0
        return self._spec

    def _spec_extras(self) -> dict[str, str]:
        """What a mechanism built on this protocol adds to every group spec (the disk transport: its folder)."""
        return {}

    def abort(self, failed: Mapping[str, str]) -> None:
        """Give the open generation up because of `failed` (member -> why: its process died, was replaced...).

        Thread-safe, and meant to be called while another thread is blocked in `wait_for_receivers` or `send`:
        that call raises WeightTransferError naming `failed` within a poll interval instead of waiting out its
        timeout, and so does any later call on this generation. `open_group` starts the next one."""
        if self._aborted is None:
            self._aborted = dict(failed) or {"(unnamed)": "aborted"}

    def waiting_on(self) -> list[str]:
        """The members whose readiness (join, ready, ack) the call under way still waits for; from any thread
        (the store client serializes its calls). Empty while bytes move: gloo does not say whom it waits for."""
        awaited, keys = self._awaited, self._keys
        if not awaited or keys is None:
            return []
        try:
            return [member for member, key in awaited.items() if not keys.check([key])]
        except (RuntimeError, dist.DistError):
            return []

    def wait_for_receivers(self, timeout_s: float | None = None) -> None:
        """Block until every receiver of the open generation joined; raise naming those that did not."""
        spec, keys = self._require_spec()
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        missing = self._await(keys, {member: f"joined/{rank}" for rank, member in enumerate(spec.members)
                                     if rank > 0}, timeout_s)
        if self._aborted is not None:
            raise self._give_up(keys, "status", f"weight-transfer group generation {spec.generation} not formed")
        if missing:
            absent = {spec.members[int(key.split("/")[1])]: f"never joined within {timeout_s:g}s" for key in missing}
            raise self._give_up(keys, "status", f"weight-transfer group generation {spec.generation} not formed",
                                absent, why=f"never joined: {', '.join(absent)}")
        keys.set("status", groups.STATUS_GO)
        self._form_group(spec, keys)

    def _form_group(self, spec: groups.GroupSpec, keys: dist.PrefixStore) -> None:
        """Every member joined and was told to go: build the process group the buckets travel over."""
        # A member can die after joining and before its group exists: abort() ends these waits too, and the
        # ABORTED mark sends the members still forming it away, instead of all of us waiting out the timeout.
        try:
            self._group = groups.create_process_group(
                keys, 0, len(spec.members), spec.backend, spec.host, self._timeout_s, given_up=self._abort_reason
            )
            probe = torch.zeros(1, device=self._device)
            work = groups.broadcast(self._group, probe)
            if not groups.wait_work(work, self._is_aborted):
                groups.park(self._group, [work], [probe])
                self._group = None
        except (RuntimeError, dist.DistError) as error:
            if self._aborted is not None:
                raise self._give_up(keys, None, f"weight-transfer group generation {spec.generation} not formed"
                                    ) from error
            self._broken = f"formation failed: {error}"
            raise WeightTransferError(
                f"weight-transfer group generation {spec.generation}: process group formation failed: {error}"
            ) from error
        if self._group is None:
            raise self._give_up(keys, None, f"weight-transfer group generation {spec.generation} not formed")

    def send(self, named_tensors: Iterable[tuple[str, Tensor]], version: int, *, dtype: torch.dtype | None = None,
             timeout_s: float | None = None, fingerprint: bool = False) -> TransferReport:
        """See `_send`. Any push that does not commit (a failure, a fingerprint mismatch) leaves the engines'
        weights unknown, so the next push is full and repairs them."""
        with self._copy.pushing(version, self.delta_sync):
            return self._send(named_tensors, version, dtype=dtype, timeout_s=timeout_s, fingerprint=fingerprint)

    def _send(self, named_tensors: Iterable[tuple[str, Tensor]], version: int, *, dtype: torch.dtype | None,
              timeout_s: float | None, fingerprint: bool) -> TransferReport:
        """Broadcast the tensors (floating ones cast to `dtype` on the way, if given) and commit `version`.

        `fingerprint`: each tensor is fingerprinted as it goes out (`fingerprint.py`), each engine fingerprints
        what it serves once loaded, and the version is committed only if they agree: otherwise `WeightsDiffer`
        names the engines and tensors. The report says which engines could not be checked.

        `timeout_s` (default: the sender's) bounds the wait for every receiver to be ready and to acknowledge.
        The tensors are read, never modified or retained; they must not change until this returns.

        The manifest (every name, dtype and shape) must reach the receivers before the first byte. Given a
        `SpecifiedTensors` (`engines.weights.stream`), it is built from the recorded specs and each tensor is
        pulled only when its bucket goes out: a source that gathers shards (Megatron) holds the buckets in
        flight, not the model. A bare iterable is listed first (references only: a trainer that yields its
        live parameters costs no memory here). A source that breaks mid-way fails the transfer
        (WeightTransferError naming no receiver) and breaks the generation.
        """
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        spec, keys = self._require_spec()
        if self._aborted is not None and self._broken is None:
            raise self._give_up(keys, None, f"weight transfer of version {version} not started")
        require_usable(self._group, self._broken, f"weight-transfer group generation {spec.generation}")
        started = time.perf_counter()
        tensors = specified(named_tensors)
        algorithm = algorithm_for(self._device) if fingerprint else None
        specs = wire_specs(tensors.specs, dtype)
        manifest = Manifest(version=version, bucket_bytes=self.bucket_bytes, direct_bytes=self.direct_bytes,
                            tensors=specs, fingerprint=algorithm, fingerprint_stride=self.fingerprint_stride,
                            keep=self.delta_sync and self._copy.keeps())
        plan = manifest.fingerprint_plan()
        sent = plan.prints() if plan is not None else None
        covered = frozenset(spec.name for spec in plan.covered(manifest.tensors)) if plan is not None else frozenset()
        prefix = f"xfer/{self._sequence}/"
        receivers = spec.receivers
        base, why_full = self._copy.base_for(specs, spec.generation) if self.delta_sync else (None, "")
        stream: Iterator[tuple[str, Tensor]] = iter(tensors)
        if base is not None:  # diffed before the manifest goes out: it says each tensor's encoding and count
            try:
                changes, payloads = self._copy.diff(specs, stream, sent, covered)
            except SourceBroke as error:
                raise self._source_broke(keys, version, error) from error
            manifest = dataclasses.replace(manifest, base_version=base, changes=changes)
            stream = iter(payloads)
        wire = manifest.wire()
        keys.set(prefix + "manifest", manifest.encode())
        missing = self._await(keys, {member: f"{prefix}ready/{rank}" for rank, member in enumerate(spec.members)
                                     if rank > 0}, timeout_s)
        if self._aborted is not None:
            raise self._give_up(keys, prefix + "go", f"weight transfer of version {version} not started")
        if missing:
            failed = {
                spec.members[int(key.rsplit("/", 1)[1])]: "not ready to receive (died or stalled)" for key in missing
            }
            raise self._give_up(keys, prefix + "go", f"weight transfer of version {version} not started", failed,
                                why=f"not ready: {', '.join(failed)}")
        keys.set(prefix + "go", groups.STATUS_GO)
        buckets = wire.buckets()
        keep = self._copy if manifest.keep and base is None else None
        try:
            with groups.single_threaded_copies(self._device):
                # a delta's tensors were fingerprinted as they were diffed
                completed = self._broadcast_buckets(stream, wire, buckets, sent if base is None else None, covered,
                                                    keep)
        except SourceBroke as error:
            raise self._source_broke(keys, version, error) from error
        except (RuntimeError, dist.DistError) as error:
            failed = {}
            if self._aborted is None:  # the receivers still waiting leave now; those that can, say why
                keys.set(groups.ABORTED, f"broadcast failed at the sender: {error}"[:1000].encode())
                failed = self._collect_acks(spec, prefix, min(timeout_s, BROKEN_ACKS_S))
            if self._aborted is not None:  # the death abort() was told of broke the collective
                raise self._give_up(keys, None, f"weight transfer of version {version} broke mid-way") from error
            self._broken = f"broadcast failed: {error}"
            raise WeightTransferError(
                f"weight transfer of version {version} broke mid-way: {error}", failed or dict.fromkeys(receivers, "?")
            ) from error
        if not completed:
            raise self._give_up(keys, None, f"weight transfer of version {version} abandoned mid-way")
        self.reached("buckets_sent")
        failed = self._collect_acks(spec, prefix, timeout_s)
        if failed and self._backend == "nccl":
            # NCCL queued the buckets without waiting for them: a receiver that died or stalled may have left them
            # pending on this GPU. The group goes now, before the watchdog takes the learner with it.
            self._let_go([])
            self._broken = "a receiver did not acknowledge; its collectives may still be pending"
        if failed and self._aborted is not None:  # every ack in: committed, whatever happened since
            raise self._give_up(keys, None, f"weight transfer of version {version} not committed")
        check = None
        if sent is not None and not failed:
            check = check_served(sent.algorithm, sent.values(), self._served_prints(spec, prefix), sent.seconds)
        self._clear_keys(keys, prefix, len(spec.members))
        self._sequence += 1
        if failed:
            raise WeightTransferError(f"weight transfer of version {version} not committed", failed)
        if check is not None and not check.ok:
            raise WeightsDiffer(f"weight transfer of version {version} not committed: {check.describe()}", check)
        self._committed = version
        seconds = time.perf_counter() - started
        if self.delta_sync:
            self._copy.committed(version, specs, spec.generation, was_delta=base is not None, seconds=seconds,
                                 full_bytes=manifest.total_bytes)
        return TransferReport(
            version=version,
            receivers=receivers,
            num_tensors=len(manifest.tensors),
            num_buckets=len(buckets),
            num_bytes=wire.total_bytes,
            seconds=seconds,
            fingerprints=check,
            delta_base=base,
            full_bytes=manifest.total_bytes,
            full_because=why_full if self.delta_sync and base is None else None,
        )

    def close_group(self) -> None:
        """Drop the open generation; a receiver still waiting in it (for keys or a collective) leaves at once."""
        if self._keys is not None and not self._keys.check([groups.ABORTED]):
            with contextlib.suppress(RuntimeError, dist.DistError):
                self._keys.set(groups.ABORTED, b"superseded by a new generation")
        _release(self._group)
        self._group, self._buffers = None, []
        self._spec, self._keys = None, None

    def close(self) -> None:
        self.close_group()

    # -- internals --------------------------------------------------------------------------------------------

    def _is_aborted(self) -> bool:
        return self._aborted is not None

    def _abort_reason(self) -> str | None:
        aborted = self._aborted
        return None if aborted is None else "; ".join(f"{member}: {why}" for member, why in aborted.items())

    def _give_up(
        self,
        keys: dist.PrefixStore,
        status_key: str | None,
        message: str,
        failed: Mapping[str, str] | None = None,
        *,
        why: str | None = None,
    ) -> WeightTransferError:
        """Mark the generation given up (for the receivers: `status_key`, if one is awaited, and the ABORTED mark)
        and return the error to raise; without `failed`, the members `abort()` named are at fault."""
        failed = dict(failed) if failed is not None else dict(self._aborted or {})
        why = why or "; ".join(f"{member}: {reason}" for member, reason in failed.items())
        self._broken = self._broken or why
        if status_key is not None:
            keys.set(status_key, groups.ABORT_PREFIX + f" {why}".encode())
        keys.set(groups.ABORTED, why.encode())
        return WeightTransferError(message, failed)

    def _source_broke(self, keys: dist.PrefixStore, version: int, error: SourceBroke) -> WeightTransferError:
        """No receiver is at fault; the ones waiting for the manifest or the next bucket leave when they see the
        mark."""
        why = f"the learner's tensors broke mid-way: {error}"
        keys.set(groups.ABORTED, why[:1000].encode())
        self._broken = why
        return WeightTransferError(f"weight transfer of version {version} broke mid-way: {error}")

    def _require_spec(self) -> tuple[groups.GroupSpec, dist.PrefixStore]:
        if self._spec is None or self._keys is None:
            raise WeightTransferError("no weight-transfer group is open; call open_group() first")
        return self._spec, self._keys

    def _broadcast_buckets(self, stream: Iterator[tuple[str, Tensor]], manifest: Manifest,
                           buckets: list[Bucket], sent: Fingerprints | None = None,
                           covered: frozenset[str] = frozenset(), keep: SenderCopy | None = None) -> bool:
        """At most IN_FLIGHT broadcasts outstanding; a packing slot is rewritten only after its last send ended.
        The tensors of `covered` are fingerprinted into `sent` as they go out (`FingerprintPlan.covered`), and every
        tensor is kept in `keep`, when given, for the deltas of later pushes.
        A bucket's tensors are pulled from `stream` once a broadcast slot is free for it, and referenced only
        until its broadcast completed (a lone tensor is sent from its own memory).

        False if `abort()` came first. Then, or when a broadcast or the stream fails, the group is let go of with
        whatever is still pending on it (`group.park`): destroying it here would block until gloo's timeout."""
        in_flight: deque[tuple[dist.Work, Tensor]] = deque()
        slot_work: list[dist.Work | None] = [None] * groups.IN_FLIGHT
        # A packed bucket's bytes stay in its slot until the slot is rewritten, so its fingerprints wait for that
        # or for the last bucket posted: the receivers are then still loading, and this end has nothing else to do.
        unprinted: list[list[tuple[str, Tensor]]] = [[] for _ in range(groups.IN_FLIGHT)]
        next_slot = 0
        try:
            for bucket in buckets:
                while len(in_flight) >= groups.IN_FLIGHT:
                    if not self._wait(in_flight[0][0]):
                        return self._let_go(in_flight)
                    in_flight.popleft()
                pulled = [tensor for _, tensor in islice(stream, len(bucket.entries))]
                if keep is not None:
                    for (index, _), tensor in zip(bucket.entries, pulled, strict=True):
                        keep.hold(manifest.tensors[index], tensor)
                if bucket.nbytes == 0:
                    continue
                payload, slot = self._direct_payload(pulled, manifest, bucket), None
                if payload is None:
                    slot, next_slot = next_slot, (next_slot + 1) % groups.IN_FLIGHT
                    if slot_work[slot] is not None and not self._wait(slot_work[slot]):
                        return self._let_go(in_flight)
                    _print(sent, unprinted[slot])
                    payload = groups.slot_buffer(self._buffers, slot, bucket.nbytes, self._device)[: bucket.nbytes]
                    for (index, offset), tensor in zip(bucket.entries, pulled, strict=True):
                        tensor_view(payload, offset, manifest.tensors[index]).copy_(tensor)
                del pulled
                work = groups.broadcast(self._group, payload)
                if sent is not None:  # the bytes going out, in the wire dtype
                    views = [(manifest.tensors[index].name, tensor_view(payload, offset, manifest.tensors[index]))
                             for index, offset in bucket.entries if manifest.tensors[index].name in covered]
                    if slot is None:
                        _print(sent, views)  # read while the broadcast runs: the tensor is not held past it
                    else:
                        unprinted[slot] = views
                if slot is not None:
                    slot_work[slot] = work
                in_flight.append((work, payload))
                del payload
            next(stream, None)  # past the last spec: raises SourceBroke if the source has more
            for views in unprinted:
                _print(sent, views)
            while in_flight:
                if not self._wait(in_flight[0][0]):
                    return self._let_go(in_flight)
                in_flight.popleft()
        except (RuntimeError, dist.DistError, SourceBroke):
            self._let_go(in_flight)
            raise
        return True

    def _let_go(self, in_flight: deque[tuple[dist.Work, Tensor]]) -> bool:
        pending = [work for work, _ in in_flight]
        groups.park(self._group, pending, [payload for _, payload in in_flight] + self._buffers)
        _release(self._group)
        self._group, self._buffers = None, []
        return False

    def _wait(self, work: dist.Work) -> bool:
        """NCCL's wait only orders streams, it never blocks this thread for long: nothing to slice there."""
        if self._backend == "nccl":
            work.wait()
            return True
        return groups.wait_work(work, self._is_aborted)

    def _direct_payload(self, pulled: list[Tensor], manifest: Manifest, bucket: Bucket) -> Tensor | None:
        """The tensor's own bytes when a bucket is one tensor already in wire form (no cast, no copy)."""
        if len(bucket.entries) != 1:
            return None
        index, _ = bucket.entries[0]
        return groups.own_bytes(pulled[0], manifest.tensors[index].dtype, self._device)

    def _collect_acks(self, spec: groups.GroupSpec, prefix: str, timeout_s: float) -> dict[str, str]:
        keys = {spec.members[rank]: f"{prefix}ack/{rank}" for rank in range(1, len(spec.members))}
        self._awaited = keys
        try:
            return groups.failed_replies(self._keys, keys, timeout_s, expected=OK, stop=self._is_aborted,
                                         silent=f"no acknowledgement within {timeout_s:g}s (died or stalled)")
        finally:
            self._awaited = {}

    def _await(self, keys: dist.PrefixStore, key_by_member: dict[str, str], timeout_s: float) -> list[str]:
        """The keys still missing after waiting for all of them (`abort()` ends the wait); meanwhile
        `waiting_on()` names the members whose key has not appeared."""
        self._awaited = key_by_member
        try:
            return groups.missing_keys(keys, list(key_by_member.values()), timeout_s, stop=self._is_aborted)
        finally:
            self._awaited = {}

    def _served_prints(self, spec: groups.GroupSpec, prefix: str) -> dict[str, ServedPrints | str]:
        """Each receiver's fingerprints of what it serves, written before its acknowledgement; or why none."""
        assert self._keys is not None
        served: dict[str, ServedPrints | str] = {}
        for rank in range(1, len(spec.members)):
            key = f"{prefix}prints/{rank}"
            if not self._keys.check([key]):
                served[spec.members[rank]] = "its engine cannot fingerprint the weights it serves"
                continue
            try:
                served[spec.members[rank]] = ServedPrints.decode(self._keys.get(key))
            except ValueError as error:
                served[spec.members[rank]] = str(error)
        return served

    @staticmethod
    def _clear_keys(keys: dist.PrefixStore, prefix: str, size: int) -> None:
        for key in ("manifest", "go", *(f"{kind}/{r}" for kind in ("ready", "ack") for r in range(1, size))):
            keys.delete_key(prefix + key)
        for rank in range(1, size):
            if keys.check([f"{prefix}prints/{rank}"]):
                keys.delete_key(f"{prefix}prints/{rank}")


def _print(sent: Fingerprints | None, views: list[tuple[str, Tensor]]) -> None:
    """Fingerprint the bytes of `views` (a packed slot's, or a lone tensor's) into `sent`, and forget them."""
    if sent is not None:
        for name, view in views:
            sent.add(name, view)
    views.clear()


def _release(group: object) -> None:
    """What a generation's group holds goes with it: a staged-copy group's shared-memory files; an NCCL
    communicator, aborted (`groups.abort_nccl`)."""
    close = getattr(group, "close", None)
    if close is not None:
        close()
    groups.abort_nccl(group)
