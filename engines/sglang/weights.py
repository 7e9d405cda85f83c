"""Weights from the learner to SGLang servers: the learner's sender and the rollout worker's loader.

With SGLang the SERVER process receives the weights, so the transfer has three parties: the learner (rank 0 of
the weight-update group, `SglangWeightSender`), each server (ranks `rank_offset .. rank_offset + tp - 1`,
joined through its `/init_weights_update_group`) and each rollout worker, which drives its server's HTTP
calls (`SglangWeightLoader`). The group is built exactly as SGLang builds it (`weight_group.py`) and tensors
travel exactly as SGLang receives them: per `/update_weights_from_distributed` call, one broadcast from rank 0
per tensor, in `names` order, each in its own dtype. SGLang 0.5.x also offers `load_format="flattened_bucket"`
(one broadcast of all of a call's tensors flattened together); we do not use it because its buffer layout is
an SGLang implementation detail that has changed between releases, while per-tensor broadcasts are the stable
contract, and on NCCL the per-collective cost is small next to the bytes of a large model.

Coordination travels through the rendezvous store the learner hosts (the same `tcp://` address the servers
joined), under a key prefix of our own (`weight_store.py`), mirroring `engines/weights/torch_distributed.py`:

1. The learner publishes the manifest (names, dtypes, shapes, how they split into calls) under the version.
2. Each loader reads it, pauses its server's generation (SGLang's "abort" mode; the client resumes the aborted
   requests afterwards, see `client.py`), flushes the server's cache (`GET /flush_cache`, retried until the
   aborted requests have left the scheduler), opens SGLang's weight-update session (`/begin_weight_update`,
   where the server has one) and says "ready" (or why it is not); the learner waits for all of them (naming
   the missing ones and telling the others to stop) and says "go".
3. For each bucket the learner pulls its tensors (`engines.weights.stream`: a source that gathers shards holds
   one bucket, not the model), says "bucket i" and broadcasts them; the loader waits for that word, then
   posts `/update_weights_from_distributed` (always `flush_cache=False`: the cache was flushed before, and
   SGLang 0.5.15 takes its server down when a flush it was asked for fails). The learner waits for each
   bucket, with a deadline, before pulling the next. If the learner's own tensors fail instead, "bucket i"
   says so and no server is left inside a call waiting for a broadcast that will not come. A refused call
   is acknowledged as an error at once, so the learner stops waiting for a broadcast nobody receives. Then
   the loader ends the session, and, when the manifest asks for fingerprints, writes its server's own checksum
   of what it now serves (`/weights_checker`; or why there is none), continues generation and acknowledges with
   the outcome of every HTTP call. The learner commits the version only when every acknowledgement is "ok" and
   the checksums show no engine serving other weights (`checksums.py`).

A transfer that failed in any way breaks the group: the learner tears its end down and forms a new one (a new
group name) at the next update, and each loader destroys the old group on its server, so communicators do not
pile up there. The learner never relies on a collective raising: on NCCL `wait()` does not block the host and a
collective that outlives the group timeout makes the watchdog end the process, so it polls each bucket's
completion against its own deadline (set well inside the group's timeout) and aborts the group when it passes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from bus.address import free_port
from engines.sglang import protocol, weight_store
from engines.sglang.checksums import ServedChecksum, ServedHistory
from engines.sglang.client import SglangEngine, SglangError
from engines.sglang.store_sender import DEFAULT_BUCKET_BYTES, SglangStoreSender
from engines.sglang.weight_group import WeightGroup, broadcastable, join_weight_group
from engines.sglang.weight_store import ABORT_PREFIX, ERROR_PREFIX, GO, OK, READY, SglangGroupSpec
from engines.weights.base import WeightTransferError
from engines.weights.group import collective_timeout_s, transfer_device
from engines.weights.manifest import Manifest, plan_buckets

DESTROY_TIMEOUT_S = 10.0  # a destroy waits behind a receive the server may be stuck in; give up and retry later


class SglangWeightSender(SglangStoreSender):
    """The broadcast mechanism: the servers join the learner's group, and every bucket is broadcast to them."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        backend: str = "gloo",
        gpus_per_engine: int = 1,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 120.0,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(host=host, gpus_per_engine=gpus_per_engine, bucket_bytes=bucket_bytes, timeout_s=timeout_s)
        self.backend = backend
        self.device = transfer_device(backend, device)  # type: ignore[arg-type]  # SGLang takes gloo or nccl
        self._group: WeightGroup | None = None
        self._parked: list[tuple[WeightGroup, list[dist.Work]]] = []  # abandoned groups with work still pending

    def open_group(self, members: Sequence[str]) -> SglangGroupSpec:
        members = self._checked(members)
        self.close_group()
        return self._new_spec(members, free_port(self.host), backend=self.backend)

    def wait_for_receivers(self, timeout_s: float | None = None) -> None:
        """Host the rendezvous and block until every server rank joined (their `/init_weights_update_group`)."""
        spec = self._require_spec()
        timeout_s = timeout_s or self.timeout_s
        try:
            self._group = join_weight_group(
                backend=spec.backend,
                master_address=spec.master_address,
                master_port=spec.master_port,
                rank=0,
                world_size=spec.world_size,
                group_name=spec.group_name,
                timeout_s=timeout_s,
                collective_timeout_s=collective_timeout_s(self.timeout_s),
                given_up=lambda: None if self._aborted is None else str(self._aborted),
            )
        except (RuntimeError, ValueError, dist.DistError) as error:
            self._broken = f"formation failed: {error}"
            raise self._named(WeightTransferError(
                f"weight group {spec.group_name}: servers did not all join within {timeout_s:g}s",
                dict.fromkeys(spec.receivers, str(error)[:200]),
            )) from error

    def _store(self) -> dist.Store | None:
        return None if self._group is None else self._group.store

    def _print_device(self) -> torch.device:
        return self.device

    def _deliver_bucket(self, keys: dist.Store, spec: SglangGroupSpec, dtype: torch.dtype | None, timeout_s: float,
                        position: int, pairs: list[tuple[str, Tensor]], where: str) -> None:
        assert self._group is not None
        # Kept until the bucket completed: an asynchronous broadcast reads its tensor until then.
        wire = [_wire_tensor(tensor, dtype, self.device) for _, tensor in pairs]
        keys.set(f"bucket/{position}", GO)
        try:
            work = [dist.broadcast(broadcastable(tensor), src=0, group=self._group.group, async_op=True)
                    for tensor in wire]
        except (RuntimeError, dist.DistError) as error:
            failed = weight_store.early_failures(keys, spec) or dict.fromkeys(
                spec.receivers, f"broadcast failed: {error}"
            )
            self._abandon_group(f"{where}: broadcast failed: {error}", [])
            raise WeightTransferError(f"{where} broke: {error}", failed) from error
        self._fingerprint_sent(zip([name for name, _ in pairs], wire, strict=True))  # read while the broadcasts run
        # Inside the group's own timeout, so this deadline, not the NCCL watchdog, ends a stuck bucket.
        deadline_s = min(timeout_s, 0.8 * collective_timeout_s(self.timeout_s))
        failed = weight_store.await_bucket(work, keys, spec, deadline_s, where, self._is_aborted)
        if failed:
            self._abandon_group(f"{where} failed: {failed}", work)
            raise WeightTransferError(f"{where} failed", failed)

    def _abandon_group(self, reason: str, work: list[dist.Work]) -> None:
        """A collective may still be pending on a peer that will never take part: let go of the group, don't wait.

        NCCL: the communicator is aborted at once. Gloo has no abort, and destroying a group whose collective is
        pending blocks until the peer goes away, so the group is parked and destroyed once its work completed
        (the loader destroys the server's end, which fails the pending send).
        """
        self._broken = reason
        group, self._group = self._group, None
        if group is None:
            return
        if group.backend == "nccl":
            group.abort()
        else:
            self._parked.append((group, work))
        self._reap_parked()

    def _reap_parked(self) -> None:
        still = []
        for group, work in self._parked:
            if all(handle.is_completed() for handle in work):
                with contextlib.suppress(RuntimeError, ValueError):
                    group.destroy()
            else:
                still.append((group, work))
        self._parked = still

    def close_group(self) -> None:
        if self._group is not None:
            with contextlib.suppress(Exception):
                self._group.destroy()
        self._group, self._spec = None, None
        self._reap_parked()

    def close(self) -> None:
        self.close_group()


class SglangWeightLoader:
    """A rollout worker's end: joins its server to each new group and drives the per-bucket HTTP calls."""

    sessions = True  # its loads run inside SGLang's weight-update session, where the server has one

    def __init__(self, engine: SglangEngine, engine_name: str, *, log: Any = None) -> None:
        self.engine = engine
        self.engine_name = engine_name
        self.log = log
        self._group_name: str | None = None
        self._server_starts: int | None = None
        self._stale_groups: set[str] = set()  # groups of failed transfers the server may still hold
        self._served = ServedHistory()  # its server's per-tensor checksums after the last checked load

    async def apply(self, group: Mapping[str, Any], version: int, timeout_s: float) -> None:
        """Receive `version` on the engine's server; raises WeightTransferError naming what failed."""
        spec = SglangGroupSpec.from_dict(group)
        await self._join(spec, timeout_s)
        try:
            async with self.engine.memory_pinned():  # a colocated server keeps its memory until the load is done
                await self._receive(spec, version, timeout_s)
        except BaseException:
            await self._forget_group(timeout_s)
            raise
        self.engine.set_version(version)
        if self.log is not None:
            self.log.info("weights loaded by the SGLang server", version=version, group=spec.group_name)

    def close(self) -> None:
        """Nothing to release here: the server's groups are destroyed at the next join, or go with the server."""

    async def _receive(self, spec: SglangGroupSpec, version: int, timeout_s: float) -> None:
        keys = await asyncio.to_thread(weight_store.connect_keys, spec, version, timeout_s)
        manifest = await asyncio.to_thread(weight_store.read_manifest, keys, timeout_s, self.engine_name)
        await self.engine.pause("keep")
        try:
            try:
                await self.engine.flush_cache(deadline_s=timeout_s)
                await self.engine.take_back_memory([protocol.MEMORY_WEIGHTS])  # released while the learner trained
                session = await self.engine.begin_weight_update() if self.sessions else False
            except SglangError as error:
                await asyncio.to_thread(keys.set, f"ready/{self.engine_name}", ERROR_PREFIX + str(error).encode())
                raise WeightTransferError(
                    f"{self.engine_name}: server not ready for version {version}: {error}",
                    {self.engine_name: str(error)},
                ) from error
            try:
                await asyncio.to_thread(keys.set, f"ready/{self.engine_name}", READY)
                go = await asyncio.to_thread(weight_store.wait_go, keys, 2 * timeout_s, self.engine_name, version)
                if go != GO:
                    raise WeightTransferError(
                        f"{self.engine_name}: transfer of version {version} aborted: "
                        f"{go.removeprefix(ABORT_PREFIX).decode(errors='replace').strip()}"
                    )
                outcome = await self._load_buckets(keys, manifest, spec, version, timeout_s)
                if outcome is not None:
                    # At once: the learner is waiting for a broadcast this server will not receive.
                    await asyncio.to_thread(keys.set, f"ack/{self.engine_name}", ERROR_PREFIX + outcome.encode())
            finally:
                if session:
                    try:
                        await self.engine.end_weight_update()
                    except SglangError as error:
                        outcome = f"{protocol.END_WEIGHT_UPDATE.path} failed: {error}"
            if outcome is None and manifest.fingerprint is not None:  # still paused: what the next token will use
                await self._report_checksum(keys, version, timeout_s)
        finally:
            with contextlib.suppress(SglangError):
                await self.engine.resume()
        await asyncio.to_thread(
            keys.set, f"ack/{self.engine_name}", OK if outcome is None else ERROR_PREFIX + outcome.encode()
        )
        if outcome is not None:
            raise WeightTransferError(f"{self.engine_name}: server refused version {version}: {outcome}")

    async def _report_checksum(self, keys: dist.PrefixStore, version: int, timeout_s: float) -> None:
        """The server's own checksum of what it serves, for the learner's check (`checksums.py`), or why there is
        none, written before the acknowledgement. Never fails the load: the weights did load."""
        try:
            # Half the transfer's deadline: the acknowledgement that follows must still reach the learner within it.
            answer = await self.engine.weight_checksum(timeout=timeout_s / 2)
        except SglangError as error:
            served = ServedChecksum(None, f"checksum failed: {error}"[:500])
        else:
            served = (ServedChecksum(None, f"its server has no {protocol.WEIGHTS_CHECKER.path}") if answer is None
                      else self._served.report(answer.engine, answer.tensors, version=version,
                                               server_starts=self.engine.restarts))
        await asyncio.to_thread(keys.set, weight_store.checksum_key(self.engine_name), served.encode())

    async def _join(self, spec: SglangGroupSpec, timeout_s: float) -> None:
        starts = self.engine.restarts
        if self._server_starts != starts:
            self._stale_groups.clear()  # a restarted server holds no group
        if self._group_name == spec.group_name and self._server_starts == starts:
            return
        if self._group_name is not None and self._server_starts == starts:
            self._stale_groups.add(self._group_name)
        self._group_name = None
        for name in sorted(self._stale_groups):
            await self._destroy(name, timeout_s)
        try:
            await self.engine.init_weights_update_group(
                master_address=spec.master_address,
                master_port=spec.master_port,
                rank_offset=spec.rank_offset(self.engine_name),
                world_size=spec.world_size,
                group_name=spec.group_name,
                backend=spec.backend,
                timeout=timeout_s + 10,
            )
        except SglangError as error:
            self._stale_groups.add(spec.group_name)  # a join that timed out here may still complete there
            raise WeightTransferError(
                f"{self.engine_name}: could not join weight group {spec.group_name}: {error}",
                {self.engine_name: str(error)},
            ) from error
        self._group_name, self._server_starts = spec.group_name, starts

    async def _forget_group(self, timeout_s: float) -> None:
        """After a failed transfer the learner forms a new group; free this one on the server now."""
        name, self._group_name = self._group_name, None
        if name is not None and self._server_starts == self.engine.restarts:
            self._stale_groups.add(name)
            await self._destroy(name, timeout_s)

    async def _destroy(self, name: str, timeout_s: float) -> None:
        try:
            await self.engine.destroy_weights_update_group(name, timeout=min(timeout_s, DESTROY_TIMEOUT_S))
        except SglangError as error:
            if error.status is None:  # no answer (the server may be stuck in a receive): try again next join
                return
        self._stale_groups.discard(name)

    async def _load_buckets(
        self, keys: dist.PrefixStore, manifest: Manifest, spec: SglangGroupSpec, version: int, timeout_s: float
    ) -> str | None:
        """None once every bucket loaded, else what went wrong. A bucket's call is posted only once the learner
        said it is on its way: the server then never waits inside a call for a broadcast that will not come."""
        buckets = plan_buckets(manifest.tensors, manifest.bucket_bytes, manifest.direct_bytes)
        for position, bucket in enumerate(buckets):
            word = await asyncio.to_thread(weight_store.wait_bucket, keys, position, timeout_s)
            if word != GO:
                return f"bucket {position + 1}/{len(buckets)} not sent: {word.decode(errors='replace')}"[:500]
            specs = [manifest.tensors[index] for index, _ in bucket.entries]
            try:
                await self.engine.update_weights_from_distributed(
                    names=[s.name for s in specs],
                    dtypes=[protocol.dtype_name(s.dtype) for s in specs],
                    shapes=[list(s.shape) for s in specs],
                    group_name=spec.group_name,
                    # On the last call only: a transfer that fails part-way must not leave the server claiming a
                    # version the learner never committed (its tokens would pass for fresher than they are).
                    weight_version=str(version) if position == len(buckets) - 1 else None,
                    flush_cache=False,
                    timeout=timeout_s + 10,
                )
            except SglangError as error:
                return str(error)[:500]
        return None


def _wire_tensor(tensor: Tensor, dtype: torch.dtype | None, device: torch.device) -> Tensor:
    """What goes on the wire: contiguous, on the transfer device, floating tensors cast to `dtype` if given."""
    wire_dtype = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
    return tensor.detach().to(device=device, dtype=wire_dtype).contiguous()
