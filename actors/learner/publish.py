"""The learner's end of weight transfer: group membership over the bus, bytes through the chosen mechanism.

The learner forms a transfer group of itself and every live rollout worker (a new generation whenever that set
changes or a transfer broke), then for each update sends one `WeightUpdateOrder` per engine over the bus while
its sender moves the tensors. Each engine joins the generation if it is new to it, loads the update through the
loader its order names, and replies; the version counts as committed only when every engine acknowledged it. A
failed transfer is logged and retried at the next update with the engines alive then; the learner's own state
is never touched by it.

A group is a set of processes, not of names: a worker restarted under its old name is a new member (its roster
incarnation and pid changed), so it joins a new generation. When the roster says a member of the group under way
died or was replaced, the push is given up at once (the sender's `abort`) and started again with the live
engines: the transfer never waits out its timeout for a process known to be gone.

The mechanism is chosen once, here (`transport_name`), from the run's configuration; everything after that goes
through `engines.weights.transport`, so this module knows no mechanism by name.

In a run of several policies each policy's learner pushes its own LoRA adapter to the same engines: its sender
names itself by the learner's actor id ("learner@solver"), so an engine keeps one transfer group per learner, and
each order names the adapter (`WeightUpdateOrder.adapter`, the policy) the tensors replace. A run of one policy
pushes as "learner" with no adapter named.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from actors.config import RunConfig
from actors.config.engines import engine_spec, weight_backend
from actors.config.rollout_fp8 import rolls_out_fp8
from actors.extensions.load import weight_disk_post_write
from actors.learner.weight_checks import WeightCheckLog, WeightsCorrupted
from actors.runtime import chaos
from actors.runtime.waits import Waits
from bus.schema import Ack, Error, WeightUpdateOrder
from engines.training.base import WeightLayout
from engines.weights.base import (
    REPAIR,
    GroupHandle,
    TransferReport,
    WeightsDiffer,
    WeightSender,
    WeightTransferError,
)
from engines.weights.fp8 import quantised_push
from engines.weights.manifest import TensorSpec
from engines.weights.stream import SourceBroke, SpecifiedTensors, record_specs
from engines.weights.transport import (
    DISK,
    TORCH_DISTRIBUTED,
    DiskOptions,
    SenderOptions,
    WeightTransport,
    is_plugin,
    resolve_transport,
)

SENDER_NAME = "learner"  # a one-policy run's learner: its actor id
NamedTensors = Iterable[tuple[str, torch.Tensor]]
ATTEMPTS = 3  # tries of one push whose group keeps losing members (a fresh generation each)
WAITING_WARNING_S = 10.0  # a push still short of acknowledgements names the silent engines this often
NO_ENGINE_WARNING_S = 30.0  # "no live engine to push to" at most this often


@dataclass(frozen=True)
class EngineRef:
    """A live rollout worker as a push addresses it. `incarnation` and `pid` tell a process from the one it
    replaced under the same actor id; the group is keyed on them, so a restarted worker joins a new generation."""

    endpoint: str
    incarnation: int = 0
    pid: int = 0


def transport_name(config: RunConfig) -> str:
    """The mechanism for this run: a `module:attr` in --weight-transport is a plugin; else the engine decides
    (its spec: an SGLang server loads a LoRA run's adapter by name rather than receiving weights)."""
    if is_plugin(config.weights.weight_transport):
        return config.weights.weight_transport
    spec = engine_spec(config.engine.rollout_engine)
    disk = config.weights.weight_transport == "disk"
    if spec is None:  # a plugin engine loads torch.distributed pushes, or names its own --weight-transport
        return DISK if disk else TORCH_DISTRIBUTED
    return spec.transport(colocate=config.placement.colocate, lora=config.lora.enabled, disk=disk)


def transfer_backend(config: RunConfig) -> str:
    """gloo, nccl or cuda_ipc: as configured, else (auto, or a plugin) by the launcher's rule for this machine.

    The launcher resolves `auto` on the head; a learner started another way decides the same way here.
    """
    if config.weights.weight_transport in ("gloo", "nccl", "cuda_ipc", "shm", "disk"):
        return config.weights.weight_transport
    return weight_backend(cuda=torch.cuda.is_available(), shared=False, colocate=config.placement.colocate)


def sender_options(config: RunConfig, host: str) -> SenderOptions:
    return SenderOptions(
        host=host,
        backend=transfer_backend(config),
        timeout_s=config.weights.weight_transfer_timeout,
        gpus_per_engine=config.engine.rollout_num_gpus_per_engine,
        fingerprint_stride=config.weights.weight_check_stride,
        delta_sync=config.weights.weight_delta_sync,
        delta_anchor=config.weights.weight_delta_anchor,
        delta_backoff=config.weights.weight_delta_backoff,
        bucket_bytes=config.weights.weight_bucket_bytes,
        disk=disk_options(config),
    )


def disk_options(config: RunConfig) -> DiskOptions | None:
    """The folder, its settings and the post-write hook (loaded now) of a --weight-transport disk run, else None."""
    weights = config.weights
    if weights.weight_transport != "disk" or weights.weight_disk_dir is None:
        return None
    return DiskOptions(directory=weights.weight_disk_dir, keep_files=weights.weight_disk_keep_files,
                       local_directory=weights.weight_disk_local_dir, post_write=weight_disk_post_write(config))


def push_dtype(config: RunConfig) -> torch.dtype | None:
    """With --bf16 the engines serve bfloat16, so the bytes travel as bfloat16 (half of float32's)."""
    return torch.bfloat16 if config.model.bf16 else None


def publisher_for(config: RunConfig, host: str, **wiring: Any) -> WeightPublisher:
    """The run's publisher: its mechanism (a plugin is imported now, so a bad path fails at start-up), the
    sender's options and the push dtype from `config`; `wiring` is the rest of `WeightPublisher`'s arguments."""
    transport = resolve_transport(transport_name(config))
    if config.weights.weight_delta_sync and not transport.delta_sync:
        raise ValueError(f"--weight-delta-sync: the {transport.name} weight transport sends every push whole; delta "
                         f"pushes are built for {TORCH_DISTRIBUTED} (torch engines over gloo, NCCL or shared memory) "
                         f"and for the shared folder (--weight-transport disk: torch engines, and SGLang servers, "
                         f"whose update endpoints take whole tensors only, through a local checkpoint each host "
                         f"patches: --weight-disk-local-dir)")
    if (config.weights.weight_delta_sync and transport.delta_needs_local_directory
            and not config.weights.weight_disk_local_dir):
        raise ValueError(f"--weight-delta-sync over the {transport.name} weight transport needs "
                         "--weight-disk-local-dir (slime's --update-weight-local-checkpoint-dir): SGLang reloads "
                         "checkpoints whole, so each rollout worker keeps the one its server reloads in that folder "
                         "on its own disk and writes each delta into it")
    publisher = WeightPublisher(transport, sender_options(config, host), dtype=push_dtype(config),
                                weight_check=config.weights.weight_check,
                                fp8=rolls_out_fp8(config.weights, config.model.hf_checkpoint), **wiring)
    if config.weights.weight_delta_sync and push_dtype(config) is None:
        publisher.log.warning("--weight-delta-sync pushes float32 here (no --bf16): an optimizer step changes about "
                              "98% of float32 elements (tools/bench/weight_deltas.py), so a delta is nearly as large "
                              "as a full push and slower to make; it pays with --bf16 pushes (about 4% change)")
    return publisher


def sent_layout(config: RunConfig) -> WeightLayout:
    """The layout the trainer's tensors go out in (`Trainer.named_tensors`): the checkpoint's for engines that
    load checkpoint names (SGLang's MoE models know no stacked experts), else transformers' in memory."""
    return "checkpoint" if resolve_transport(transport_name(config)).checkpoint_names else "model"


class WeightPublisher:
    """Pushes versions to the live engines; `committed_version` is the last one every engine acknowledged.

    `engines()` lists the live rollout workers (`live_engines`); `tensors()` yields the weights to send (a
    generator is closed after each transfer, so one that holds a lock releases it). The sender is built on the
    first push, from `transport`. The learner calls `roster_changed()` on every roster update. `sender_name` is
    the group's first member (the learner's actor id); `adapter`, the named adapter every order replaces (a
    policy's), None for the engines' own weights. `fp8`: the decoder's projections travel quantised to FP8
    (`engines.weights.fp8`, --rollout-fp8), the rest in `dtype`.
    """

    def __init__(
        self,
        transport: WeightTransport,
        options: SenderOptions,
        *,
        engines: Callable[[], Mapping[str, EngineRef]],
        tensors: Callable[[], NamedTensors],
        zmq: Any,
        security: Any,
        client_id: str,
        counters: Any,
        log: Any,
        dtype: torch.dtype | None = None,
        waits: Waits | None = None,
        weight_check: str = "off",
        check_log: WeightCheckLog | None = None,
        sender_name: str = SENDER_NAME,
        adapter: str | None = None,
        fp8: bool = False,
    ) -> None:
        self.transport, self.options = transport, options
        self.sender_name, self.adapter, self.fp8 = sender_name, adapter, fp8
        self.engines, self.tensors = engines, tensors
        self.zmq, self.security, self.client_id = zmq, security, client_id
        self.counters, self.log, self.dtype = counters, log, dtype
        self.waits = waits or Waits()
        self.weight_check, self.check_log = weight_check, check_log or WeightCheckLog(None)
        self.committed_version: int | None = None
        self._sender: WeightSender | None = None
        self._tensor_specs: tuple[TensorSpec, ...] | None = None  # recorded at the first push
        self._spec: GroupHandle | None = None
        self._group: dict[str, EngineRef] | None = None  # the open generation's members, None: form a new one
        self._pushing: dict[str, EngineRef] | None = None  # the group of the push under way
        self._lost: dict[str, str] = {}  # members the push under way lost, and how
        self._lost_signal: asyncio.Event | None = None  # set with _lost: the push under way stops waiting
        self._stopping: str | None = None  # why pushes are over (the learner stops)
        self._clients: dict[str, tuple[str, Any]] = {}
        self._quiet_until = 0.0
        # Clear from `reads_begin` until the push beside the next step has read the weights (or will not).
        self._weights_read = threading.Event()
        self._weights_read.set()

    def reads_begin(self) -> None:
        """Call right before starting `publish(version, beside_training=True)` as a task, before the next step can
        reach its update: from now the trainer's `wait_for_reads` holds its first write of the weights until this
        push has read them."""
        self._weights_read.clear()

    def wait_for_reads(self, timeout_s: float) -> None:
        """In the trainer's thread, right before it writes the weights (the trainer's `update_gate`)."""
        if not self._weights_read.wait(timeout_s):
            raise TimeoutError(f"the trainer's update waited {timeout_s:.0f} s for the weight push beside it to read "
                               "the weights; the transfer is stuck (see the learner's weight push warnings)")

    async def publish(self, version: int, *, beside_training: bool = False) -> bool:
        """Push the learner's current weights as `version`; True once every live engine acknowledged.

        A push whose group loses a member meanwhile (see `roster_changed`) starts again at once with the engines
        alive then, up to ATTEMPTS times; any other failure waits for the next update. `beside_training`: the next
        step runs meanwhile (after `reads_begin`), so once this push has read the weights they may be the next
        version's, and a lost member is not tried again: the next update pushes the newer weights."""
        try:
            for _ in range(ATTEMPTS):
                if self._stopping is not None or (beside_training and self._weights_read.is_set()):
                    return False
                engines = dict(self.engines())
                if not engines:
                    self._no_engine(version)
                    return False
                if self.committed_version == version and self._group == engines:
                    return True  # every live engine acknowledged this version already
                pushed = await self._push(engines, version)
                if pushed is not None:
                    return pushed
            return False
        finally:
            # Covers the ways out before a send (no engine, a failed join, cancellation at stop); a send sets it
            # itself, in its thread.
            self._weights_read.set()

    def stop(self, reason: str) -> None:
        """No more pushes: the one under way ends now (its engines are stopping too and may never acknowledge it),
        so a stopping learner reaches its checkpoint before its launcher's grace runs out."""
        self._stopping = reason
        self._weights_read.set()  # nothing will be committed now; a step still running must not wait for it
        group, sender = self._pushing, self._sender
        if group is not None and sender is not None:
            sender.abort({name: reason for name in group})

    def roster_changed(self) -> None:
        """A member of the push under way that is dead, gone or replaced by a new process ends that push now: the
        transfer would wait its whole timeout for a process that is not coming."""
        group, sender = self._pushing, self._sender
        if group is None or sender is None or self._lost:
            return
        live = self.engines()
        lost = {
            name: "replaced by a new process" if name in live else "no longer alive"
            for name, ref in group.items()
            if live.get(name) != ref
        }
        if lost:
            self._lost = lost
            sender.abort(lost)
            if self._lost_signal is not None:
                self._lost_signal.set()

    async def _push(self, engines: dict[str, EngineRef], version: int) -> bool | None:
        """One attempt: True (committed), False (failed: next update), None (lost a member: again, now)."""
        if self._sender is None:
            self._sender = self.transport.make_sender(self.options)
            self._sender.phase_hook = _kill_point
        sender = self._sender
        # Sorted, so an engine's rank in the group (SGLang: its rank_offset) depends only on who is alive.
        names = sorted(engines)
        new_group = self._group != engines
        if new_group:
            self._spec = sender.open_group([self.sender_name, *names])
            self._group = engines
        assert self._spec is not None
        group = {**self._spec.to_dict(), "transport": self.transport.name}
        order = WeightUpdateOrder(version=version, group=group, timeout_s=self.options.timeout_s,
                                  adapter=self.adapter)
        replies = {name: asyncio.create_task(self._order(name, engines[name].endpoint, order)) for name in names}
        self._pushing, self._lost, self._lost_signal = engines, {}, asyncio.Event()
        watch = asyncio.create_task(self._watch(sender, replies, version))
        try:
            if new_group:
                await asyncio.to_thread(sender.wait_for_receivers)
            report = await asyncio.to_thread(self._send, sender, version)
            problems = await self._answers(list(replies.values()), self._lost_signal)
            if problems is None:
                raise WeightTransferError("a member of the push was lost before it answered its order", self._lost)
        except WeightsDiffer as differ:
            return self._served_differently(version, differ)
        except WeightTransferError as error:
            self._group = None  # form a fresh generation next time
            if self._stopping is not None:  # the stop gave it up (`stop`): expected, and no retry is coming
                self.counters["weights.given_up_at_stop"] += 1
                self.log.info("weight push given up: the learner is stopping", version=version,
                              reason=self._stopping, error=str(error))
                return False
            if self._lost:
                self.counters["weights.restarted"] += 1
                self.log.warning("weight push restarted without the engines it lost", lost=self._lost,
                                 version=version)
                return None
            self.counters["weights.failed"] += 1
            self.log.warning("weight transfer failed; will retry with the live engines", error=str(error))
            return False
        finally:
            self._pushing = None
            watch.cancel()
            for task in replies.values():
                task.cancel()
        refused = {name: problem for name, problem in zip(names, problems, strict=True) if problem}
        if refused:
            self._group = None
            self.log.warning("engines did not acknowledge the update", engines=sorted(refused), version=version)
            return False
        self._record_check(version, report)
        self.committed_version = sender.committed_version
        self.counters["weights.pushed"] += 1
        self._say_pushed(version, len(engines), report)
        return True

    def _say_pushed(self, version: int, engines: int, report: TransferReport) -> None:
        """What went, and under delta sync whether it was a delta or why it went whole: a push that repairs engines
        after a failed or mismatched one is a warning."""
        detail: dict[str, Any] = {}
        if report.delta_base is not None:
            self.counters["weights.delta_pushes"] += 1
            detail = {"delta_of": report.delta_base, "full_mb": round((report.full_bytes or 0) / 1e6, 1)}
        elif report.full_because is not None:
            detail = {"full_because": report.full_because}
        repairs = report.full_because is not None and report.full_because.startswith(REPAIR)
        (self.log.warning if repairs else self.log.info)(
            "weights pushed", version=version, engines=engines, seconds=round(report.seconds, 3),
            mb=round(report.num_bytes / 1e6, 1), **detail)

    @staticmethod
    async def _answers(replies: list[asyncio.Task[str | None]], lost: asyncio.Event) -> list[str | None] | None:
        """The engines' answers to their orders, in order; None as soon as `lost` is set. An engine can die after
        its part of the transfer and before it answers (the sender committed, the reply never comes); waiting
        for that answer would take the order's retries, minutes, for a process the roster says is gone."""
        answers = asyncio.ensure_future(asyncio.gather(*replies))
        given_up = asyncio.ensure_future(lost.wait())
        try:
            await asyncio.wait({answers, given_up}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            given_up.cancel()
        if answers.done():
            return list(answers.result())
        answers.cancel()
        return None

    async def _watch(self, sender: WeightSender, replies: dict[str, asyncio.Task[str | None]], version: int) -> None:
        """While a push is under way: an engine that refuses its order ends the push now (the transfer would only
        wait for it), and every WAITING_WARNING_S a warning names the engines the sender waits for (if it can
        tell, else those whose order is unanswered)."""
        started = time.monotonic()
        pending = set(replies.values())
        while pending:
            done, pending = await asyncio.wait(pending, timeout=WAITING_WARNING_S,
                                               return_when=asyncio.FIRST_COMPLETED)
            refused = {name: problem for name, task in replies.items() if task in done and (problem := task.result())}
            if refused:
                sender.abort(refused)
                return
            if not done:
                silent = sorted(name for name, task in replies.items() if not task.done())
                self.log.warning("weight push waiting on engines", engines=sender.waiting_on() or silent,
                                 version=version, seconds=round(time.monotonic() - started))

    def _served_differently(self, version: int, differ: WeightsDiffer) -> bool:
        """Every engine acknowledged, some serve other bits: the version is not committed. Stop the run under
        `--weight-check strict`; else the push counts as failed, and is tried again like any failed push."""
        self.check_log.checked(version, differ.check)
        self.counters["weights.served_differently"] += 1
        self.log.error("engines serve other weights than were pushed", version=version, engines=differ.check.differ,
                       **({"why": differ.check.why} if differ.check.why else {}))  # SGLang: no tensor to name
        if self.weight_check == "strict":
            raise WeightsCorrupted(f"version {version}: {differ.check.describe()} (--weight-check strict)")
        return False

    def _record_check(self, version: int, report: TransferReport) -> None:
        if self.weight_check == "off":
            return
        if report.fingerprints is None:
            self.check_log.not_checked(version, f"the {self.transport.name} weight transport cannot fingerprint")
            return
        self.check_log.checked(version, report.fingerprints)
        if report.fingerprints.unchecked:
            self.counters["weights.unchecked"] += 1

    def _no_engine(self, version: int) -> None:
        """Said at most every NO_ENGINE_WARNING_S; a warning once engines were served (they are gone now), before
        that only information (at start-up the engines are still loading)."""
        now = time.monotonic()
        if now >= self._quiet_until:
            self._quiet_until = now + NO_ENGINE_WARNING_S
            say = self.log.warning if self.committed_version is not None else self.log.info
            say("no live rollout engine to push weights to; waiting for one to (re)join", version=version)

    def _send(self, sender: WeightSender, version: int) -> TransferReport:
        """In a worker thread: stream the tensors into the sender, and close their generator here too (a
        learner's generator finishes its ranks' collective iteration on close, which must not block the loop).

        They stream against specs recorded at the first push (one pass that keeps nothing), so a trainer that
        gathers shards (Megatron) holds the buckets in flight, never the whole model; a source that no longer
        matches them fails this push, and they are recorded again for the next."""
        try:
            if self._tensor_specs is None:
                self._tensor_specs = record_specs(self.tensors())
            tensors = SpecifiedTensors(self._tensor_specs, self.tensors())
            dtype = self.dtype
            if self.fp8:  # the projections quantised, the rest cast, as they are pulled
                tensors, dtype = quantised_push(tensors, self.dtype), None
            try:
                return sender.send(tensors, version, dtype=dtype, fingerprint=self.weight_check != "off")
            except WeightTransferError as error:
                if isinstance(error.__cause__, SourceBroke):
                    self._tensor_specs = None
                raise
            finally:
                tensors.close()
        finally:
            self._weights_read.set()  # here, in the thread that read them: the trainer may write them now

    async def _order(self, engine: str, endpoint: str, order: WeightUpdateOrder) -> str | None:
        """None once the engine acknowledged the order; else what went wrong (logged here)."""
        client = self._client(engine, endpoint)
        try:
            with self.waits.on(engine, f"acknowledgement of version {order.version}'s weights"):
                # Three attempts under one request id: a lost reply is answered again from the engine's reply
                # cache (the load itself runs once), instead of failing a push every engine completed.
                reply = await client.call(order, timeout=order.timeout_s, retries=2)
        except Exception as error:
            self.log.warning("weight order unanswered", engine=engine, error=repr(error))
            return f"order unanswered: {error!r}"
        if isinstance(reply, Error):
            self.log.warning("engine failed to load weights", engine=engine, detail=reply.detail)
            return f"failed to load: {reply.detail}"
        if not (isinstance(reply, Ack) and reply.ok):
            return f"did not acknowledge: {reply!r}"[:300]
        return None

    def _client(self, engine: str, endpoint: str) -> Any:
        from bus import RpcClient

        known = self._clients.get(engine)
        if known is not None and known[0] == endpoint:
            return known[1]
        if known is not None:
            known[1].close()
        client = RpcClient(self.zmq, endpoint, client_id=self.client_id, security=self.security)
        self._clients[engine] = (endpoint, client)
        return client

    def close(self) -> None:
        for _, client in self._clients.values():
            client.close()
        self._clients.clear()
        if self._sender is not None:
            self._sender.close()


def _kill_point(point: str) -> None:
    """The sender's named points, as the chaos matrix's learner phases (actors.runtime.chaos)."""
    if point == "buckets_sent":
        chaos.reached("weight_push.mid")


def live_engines(members: Iterable[Any]) -> dict[str, EngineRef]:
    """Rollout workers (roster members) that serve rpc, by actor id: who a weight push goes to."""
    return {
        member.actor_id: EngineRef(member.endpoints["rpc"], member.incarnation, member.pid)
        for member in members
        if "rpc" in member.endpoints
    }
