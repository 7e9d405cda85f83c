"""Buffer: the prompt source, the groups in flight, the pool of scored samples, and the staleness gate.

The bookkeeping lives in `BufferCore`; this actor connects it to the bus. Rollout workers pull leases,
reward workers push scored groups, the learner long-polls for its next batch, the controller's roster
tells us which workers died (their leases are re-issued at once) and its version broadcasts move the
admission window forward without waiting for the learner's next request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import numpy as np

from actors.buffer.adoption import AdoptionBound, adopted_waiting
from actors.buffer.core import BatchOrderError, BufferCore
from actors.buffer.log import BufferLog
from actors.buffer.waits import admission_state, batch_wait, gauges
from actors.config import RunConfig
from actors.data.prompt_tokens import load_training_prompts
from actors.data.prompts import PromptSource, PromptStreamError
from actors.extensions.load import batch_selector, dynamic_filter, generated_groups_hook, prompt_stream
from actors.extensions.points import GeneratedGroupsHook
from actors.runtime import chaos
from actors.runtime.base import Actor
from actors.runtime.context import ActorContext
from actors.runtime.handlers import handles, on_broadcast, serves
from actors.runtime.metrics import MetricsWriter
from actors.runtime.peers import PeerStream
from actors.runtime.stopping import unless_stopped
from bus.episodes import count_episodes
from bus.schema import (
    BATCH_ORDER,
    TOPIC_VERSION,
    Ack,
    Batch,
    BatchRequest,
    Error,
    FinalCommit,
    GuestGroups,
    Lease,
    LeaseRenew,
    LeaseRequest,
    LostGroups,
    Roster,
    ScoredGroup,
    VersionAnnouncement,
    WaitState,
)
from policies.weight_versions import LearnerVersions

BATCH_POLL_SECONDS = 2.0
GUEST_HAND_BACK_S = 30.0  # how long a guest group's scores wait for their owner to take them


class Buffer(Actor):
    role = "buffer"

    def __init__(self, context: ActorContext) -> None:
        """What `on_start` builds exists from here, as None: a buffer stopped during start-up reports and closes
        what it has without guessing."""
        super().__init__(context)
        self.core: BufferCore | None = None
        self.metrics_writer: MetricsWriter | None = None
        self.generated: GeneratedGroupsHook | None = None

    async def on_start(self) -> None:
        config = self.config = self.settings.run
        log_path = buffer_log_path(self.context.run_dir)
        source = prompt_stream(config, log_path.parent / "data_source") or self._dataset(config)
        self.core = BufferCore(
            source=source, n_samples=config.rollout.n_samples_per_prompt,
            groups_per_batch=config.rollout.rollout_batch_size, max_staleness=config.buffer.max_staleness,
            lease_timeout=config.buffer.lease_timeout,
            group_filter=dynamic_filter(config),
            compact_log_bytes=int(config.buffer.buffer_log_compact_mb * 2**20),
            batch_selector=batch_selector(config),
            on_selection_error=lambda problem: self.log.error("buffer filter answer unusable", problem=problem),
            failed_sample_policy=config.buffer.failed_sample_policy,
        )
        if log_path.exists():
            replayed = self.core.restore(log_path)
            self.log.info("buffer restored from its log", records=replayed, pool=len(self.core.pool),
                          in_flight=len(self.core.in_flight), uncommitted_batches=len(self.core.served))
        self.core.log = BufferLog(log_path)
        self.batch_ready = asyncio.Condition()
        self.metrics_writer = self.open_metrics("buffer")
        self.owners: dict[str, PeerStream] = {}  # the role each guest group's scored group goes back to
        self.open_batch: tuple[int, float] | None = None  # (batch id, since) of the learner's pending request
        self.versions = LearnerVersions()  # whether the learner pushes weights: the engines move with it
        self.generated = generated_groups_hook(config)  # sees each batch's groups and the groups dropped beside it
        self.adoption = AdoptionBound.of(config)  # what may wait of our turns in other policies' episodes

    def _dataset(self, config: RunConfig) -> PromptSource:
        """--prompt-data as the buffer serves it, what was left out of it logged and counted."""
        data = config.data
        records, report = load_training_prompts(config)
        max_prompt = data.rollout_max_prompt_len or (config.rollout.rollout_max_context_len or 0) - 1
        for problem in report.skipped:
            self.log.info("skipped dataset record", problem=problem)
        if report.skipped:
            self.log.warning(report.skipped_summary(), skipped=len(report.skipped), kept=report.records)
        self.counters["data.skipped_records"] = len(report.skipped)
        if report.too_long:
            self.counters["data.skipped_long_prompts"] = report.too_long
            self.log.warning("skipped long prompts", count=report.too_long, max_prompt_tokens=max_prompt,
                             first=f"{data.prompt_data} {report.first_too_long}",
                             kept=report.records)
        return PromptSource(records, seed=config.seed if data.rollout_seed is None else data.rollout_seed,
                            shuffle=data.rollout_shuffle)

    async def run(self) -> None:
        """Expire leases as time passes; everything else is a reply to a message. A stop ends the wait between two
        checks at once: the ordered stop of a run waits for the buffer before it stops the controller."""
        while not self.stopping:
            await unless_stopped(asyncio.sleep(min(1.0, self.config.buffer.lease_timeout / 4)), self._stop_requested)
            if self.stopping:
                return
            reissued = self.core.expire_leases()
            if reissued:
                self.log.warning("leases expired; groups re-issued", groups=len(reissued))

    @serves(LeaseRequest)
    async def on_lease_request(self, sender: str, request: LeaseRequest) -> Lease:
        if request.holds_none and (reissued := self.core.worker_started(request.worker_id)):
            self.log.info("groups leased to this worker before it began generating for us re-issued",
                          worker=request.worker_id, groups=len(reissued))
        # A learner that pushes no weights (--debug-rollout-only) leaves every engine on its first version.
        weights_version = request.weights_version if self.versions.learner_pushes else None
        # Weights older than anything a batch takes still serve the groups pinned to them (an eval round's).
        too_old = weights_version is not None and self.versions.too_old(weights_version,
                                                                          self.config.buffer.max_staleness)
        try:
            leased = self.core.lease(request.worker_id, request.max_groups, training=request.training and not too_old,
                                     max_samples=request.max_samples, weights_version=weights_version)
        except PromptStreamError as error:  # a user's data source answered what cannot be used: asking again cannot
            await self.fail_run(str(error))  # help, so the run ends with what was wrong
            leased = None
        closed = admission_state(self.core)
        if closed is None:
            self.waits.end("admission")
        else:  # open from the first refusal on: how long the workers have had nothing new to generate
            self.waits.begin("admission", "learner", closed)
        room = self.adoption.room(self.core)
        if leased is None:
            return Lease(lease_id="", worker_id=request.worker_id, groups=[], expires_at=0.0,
                         version=self.core.learner_version, adoption_room=room)
        lease_id, groups = leased
        self.counters["groups.leased"] += len(groups)
        return Lease(lease_id=lease_id, worker_id=request.worker_id, groups=groups, adoption_room=room,
                     expires_at=time.time() + self.config.buffer.lease_timeout, version=self.core.learner_version)

    @serves(LeaseRenew)
    async def on_lease_renew(self, sender: str, request: LeaseRenew) -> Ack:
        renewed = self.core.renew(request.lease_id)
        return Ack(ok=renewed, error=None if renewed else f"lease {request.lease_id} is not held")

    @serves(LostGroups)
    async def on_lost_groups(self, sender: str, lost: LostGroups) -> Ack:
        reissued = self.core.groups_lost(list(zip(lost.lease_ids, lost.group_ids, strict=True)))
        self.counters["groups.lost_reissued"] += len(reissued)
        if reissued:  # at a stop the reward workers stop with groups in hand: expected, and kept for a resume
            report = self.log.info if self.stopping else self.log.warning
            report("groups re-issued", groups=len(reissued), reason=lost.reason)
        return Ack(ok=True, error=None)

    @handles(ScoredGroup)
    async def on_scored(self, sender: str, group: ScoredGroup) -> None:
        if group.host_group is not None and self.adoption.trains_no_more(self.core):
            self.counters["groups.ignored.after_last_batch"] += 1  # nobody would train it: not kept
            self.log.info("group of another policy's episode ignored: this policy trains no more batches",
                          group=group.group_id, policy=self.context.policy)
            return
        over = self.adoption.over(self.core, group)
        outcome = self.core.accept(group)
        self.counters[f"groups.{outcome}"] += 1
        if over and outcome == "adopted":  # its episode ran before the workers heard the room was spent
            self.counters["groups.adopted_over_bound"] += 1
            self.log.info("group of another policy's episode adopted over --max-adopted-waiting",
                          group=group.group_id, policy=self.context.policy, waiting=adopted_waiting(self.core),
                          bound=self.adoption.limit)
        self.waits.made_progress()
        if outcome == "guest":
            self.spawn(self._hand_back(group), name=f"buffer.hand_back.{group.group_id}")
        elif outcome.startswith("dropped"):
            reason = outcome.split(".", 1)[1]
            self.log.info("group dropped", group=group.group_id, reason=reason)
            if self.generated is not None:
                self.generated.dropped(group, reason)
        elif outcome in ("accepted", "adopted"):
            async with self.batch_ready:
                self.batch_ready.notify_all()

    @serves(BatchRequest)
    async def on_batch_request(self, sender: str, request: BatchRequest) -> Batch | Error:
        """Long-poll: answer with the batch once it can be assembled, or an empty batch after a while; a batch
        that can never be served is an Error "batch_order" (the learner fails the run with it)."""
        try:
            return await self._serve_batch(request)
        except BatchOrderError as error:
            return Error(reason=BATCH_ORDER, detail=str(error))

    async def _serve_batch(self, request: BatchRequest) -> Batch:
        deadline = asyncio.get_running_loop().time() + BATCH_POLL_SECONDS
        if self.open_batch is None or self.open_batch[0] != request.trained_batch + 1:
            self.open_batch = (request.trained_batch + 1, time.monotonic())  # kept across the learner's re-asks
        while True:
            assembled = self.core.next_batch(learner_version=request.learner_version,
                                             trained_batch=request.trained_batch,
                                             checkpointed_batch=request.checkpointed_batch,
                                             ahead=request.ahead)
            if assembled is not None:
                break
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return Batch(batch_id=request.trained_batch + 1, samples=[], staleness=[],
                             learner_version=request.learner_version)
            async with self.batch_ready:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.batch_ready.wait(), remaining)
        chaos.reached("batch_serve.mid")  # assembled and logged, not yet answered
        samples = [sample for group in assembled.groups for sample in group.samples]
        self.counters["batches.served"] += 1
        self.waits.made_progress()
        if self.open_batch is not None and self.open_batch[0] <= assembled.batch_id:
            self.open_batch = None
        if assembled.replayed:
            self.counters["batches.replayed"] += 1
        elif self.generated is not None:
            self._tell_generated(self.generated, assembled.batch_id, assembled.groups)
        staleness = np.asarray(assembled.staleness or [0], dtype=np.int64)
        self.metrics_writer.write(assembled.batch_id, {
            **gauges(self.core), "staleness.max": float(staleness.max()), "staleness.mean": float(staleness.mean()),
        })
        return Batch(batch_id=assembled.batch_id, samples=samples, staleness=list(assembled.staleness),
                     replayed=assembled.replayed, learner_version=assembled.learner_version,
                     left_out_samples=len(assembled.groups) * self.core.n_samples - count_episodes(samples))

    def _tell_generated(self, hook: GeneratedGroupsHook, batch_id: int, groups: list[ScoredGroup]) -> None:
        """The generated-groups hook on a batch first served; a user's plugin: whatever it raises, the run goes on
        (counted and reported)."""
        try:
            hook.assembled(batch_id, groups)
        except Exception as error:
            self.counters["generated_groups_hook.raised"] += 1
            self.log.error("generated-groups hook raised", batch=batch_id, error=f"{type(error).__name__}: {error}")

    @serves(FinalCommit)
    async def on_final_commit(self, sender: str, commit: FinalCommit) -> Ack:
        """The learner's last word: commit what its final checkpoint covers."""
        self.core.commit_through(commit.checkpointed_batch)
        return Ack()

    @serves(GuestGroups)
    async def on_guest_groups(self, sender: str, guests: GuestGroups) -> Ack:
        """Another role's groups (the evaluator's rounds): leased ahead of training prompts, never trained on."""
        unowned = [group.group_id for group in guests.groups if group.owner is None]
        if unowned:
            return Ack(ok=False, error=f"groups without an owner: {unowned[:3]}")
        self.counters["groups.guests_queued"] += self.core.add_guests(guests.groups)
        return Ack()

    async def _hand_back(self, group: ScoredGroup) -> None:
        """A guest group's scores to the role that owns it. One that does not take them (dead, restarting) hands its
        pending groups over again, so a loss here costs a regeneration, counted."""
        owner = self.core.guest_owners.pop(group.group_id, None)
        if owner is None:
            return
        stream = self.owners.get(owner)
        if stream is None:
            stream = self.owners[owner] = self.peer_stream(owner)
        try:
            await stream.send(group, timeout=GUEST_HAND_BACK_S)
        except (TimeoutError, asyncio.TimeoutError, ConnectionError):
            self.counters["groups.guest_hand_back_failed"] += 1

    @on_broadcast(TOPIC_VERSION)
    async def on_version(self, topic: str, announcement: VersionAnnouncement) -> None:
        if announcement.policy != self.context.policy:
            return  # another policy's learner
        self.core.note_version(step=announcement.step, version=announcement.version)
        self.versions.heard(announcement.version, announcement.weights_version)
        async with self.batch_ready:  # a prefetch waiting for this step's version can now be measured
            self.batch_ready.notify_all()

    async def on_roster(self, roster: Roster) -> None:
        for event in roster.events:
            if event.kind in ("died", "left") and event.actor_id.startswith("rollout"):
                reissued = self.core.worker_gone(event.actor_id)
                if reissued and event.kind == "died":
                    self.log.warning("worker died; its groups re-issued", worker=event.actor_id,
                                     groups=len(reissued), reason=event.reason)
                elif reissued:  # a worker that stopped on purpose (the end of a run, a scale-down) hands work back
                    self.log.info("worker left; its groups re-issued", worker=event.actor_id, groups=len(reissued))
            elif event.kind in ("joined", "returned") and event.actor_id.startswith("rollout"):
                reissued = self.core.worker_started(event.actor_id)
                if reissued:
                    self.log.info("groups an earlier process of this worker held re-issued", worker=event.actor_id,
                                  groups=len(reissued))

    def describe_waits(self) -> list[WaitState]:
        """The learner's open batch request, and who holds the groups it still lacks."""
        if self.core is None or self.open_batch is None:
            return []
        batch_id, since = self.open_batch
        return [batch_wait(self.core, batch_id, time.monotonic() - since)]

    def metrics(self) -> dict[str, float]:
        found = super().metrics()
        if self.core is not None:
            found.update(gauges(self.core))
        return found

    async def on_stop(self) -> None:
        if self.core is not None and self.core.log is not None:
            self.core.log.close()
        if self.metrics_writer is not None:
            self.metrics_writer.close()


def buffer_log_path(run_dir: Path) -> Path:
    return run_dir / "buffer" / "log.msgpack"
