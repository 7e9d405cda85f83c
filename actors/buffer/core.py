"""The buffer's bookkeeping, free of sockets so every rule is testable: leases, admission, groups in flight,
the pool of scored groups, batch assembly with the staleness re-check, and exactly-once training.

Exactly once: batch k is assembled once and kept until a learner checkpoint covers it. A learner that
restarts from the checkpoint after batch c asks for batch c+1 and receives the very same groups again, so the
final model's lineage trains every accepted group once, and a batch is only forgotten when a checkpoint makes
it durable. Groups leased to a worker that dies or goes silent are re-issued when the lease expires (or at
once, when the controller announces the death); a result arriving under a revoked lease is ignored, never
double-counted.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import structlog

from actors.buffer.left_out import failed, left_out_entry, left_out_episodes
from actors.buffer.log import BufferLog
from actors.buffer.owned_groups import take_guest_groups
from actors.buffer.selection import checked_selection
from actors.data.prompts import Cursor, PromptStream
from actors.extensions.points import BatchSelector, GroupFilter, SelectionError
from bus.codec import decode, encode
from bus.episodes import count_episodes, group_problem
from bus.schema import PromptGroup, ScoredGroup
from policies.failed_samples import FailedSamplePolicy, samples_to_train
from policies.staleness import AdmissionController, staleness_of_range, staleness_of_samples, version_range


class BatchOrderError(ValueError):
    """The learner asked for a batch the buffer can never serve (its checkpoint is older than what the buffer
    committed, or it skipped ahead): asking again cannot help, so the run fails with this."""


@dataclass
class LeaseRecord:
    lease_id: str
    worker_id: str
    group_ids: set[str]
    expires_at: float
    restored: bool = False  # rebuilt from the log: granted to an earlier process of that worker, maybe


@dataclass
class AssembledBatch:
    """A batch as first assembled; a replay serves this very object again, metrics included."""

    batch_id: int
    groups: list[ScoredGroup]
    staleness: list[int]  # per sample, against learner_version
    learner_version: int = 0  # the version the batch was first requested at
    replayed: bool = False  # served before (the learner restarted from a checkpoint)


@dataclass
class BufferStats:
    started: int = 0  # distinct training groups ever started (admission counts these)
    accepted: int = 0
    trained_groups: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    reissued: int = 0
    left_out_samples: int = 0  # failed samples (episodes) of accepted groups, which trained on the others
    ignored: Counter[str] = field(default_factory=Counter)
    selection_fallbacks: Counter[str] = field(default_factory=Counter)  # batches taken oldest-first, by reason


def group_staleness(group: ScoredGroup, learner_version: int) -> list[int]:
    """Per sample, by the one definition in policies.staleness (a token newer than the learner counts too)."""
    return staleness_of_samples(learner_version, [sample.token_versions for sample in group.samples])


class BufferCore:
    def __init__(self, *, source: PromptStream, n_samples: int, groups_per_batch: int, max_staleness: int,
                 lease_timeout: float, group_filter: GroupFilter | None = None, log: BufferLog | None = None,
                 clock: Callable[[], float] = time.monotonic, compact_log_bytes: int = 0,
                 batch_selector: BatchSelector | None = None,
                 on_selection_error: Callable[[str], None] | None = None,
                 failed_sample_policy: FailedSamplePolicy = "leave_out") -> None:
        self.source = source
        self.n_samples = n_samples
        self.failed_sample_policy = failed_sample_policy
        self.lease_timeout = lease_timeout
        self.group_filter = group_filter
        self.batch_selector = batch_selector
        self.on_selection_error = on_selection_error or structlog.get_logger().error
        self.log = log
        self.clock = clock
        self.compact_log_bytes = compact_log_bytes  # 0: never compact
        self.compacted_bytes = 0  # the log's size right after the last compaction: the live state's size
        # The one holder of the batch size and the staleness bound, which admission, assembly and eviction read.
        self.admission = AdmissionController(max_staleness=max_staleness, groups_per_batch=groups_per_batch)
        self.learner_version = 0
        self.trained_batches = 0  # batches the learner has consumed; ahead of its version after a skipped step
        self.announced = (0, 0)  # (step, version): the learner's last finished step and the version it left
        self.stats = BufferStats()
        self.live_started = 0  # started minus dropped: the groups that will count toward batches
        self.reissue: deque[PromptGroup] = deque()
        self.guest_queue: deque[PromptGroup] = deque()  # groups another role owns (`add_guests`), leased first
        self.guest_owners: dict[str, str] = {}  # a scored guest group -> its owner, until handed back
        # Groups of this policy's turns in another policy's episodes (`ScoredGroup.host_group`), taken in unleased:
        # every one ever adopted, so one generated again (its host group re-issued) is not trained twice.
        self.adopted: set[str] = set()
        self.in_flight: dict[str, tuple[PromptGroup, str]] = {}
        self.prompt_groups: dict[str, PromptGroup] = {}  # every training group not yet committed
        self.leases: dict[str, LeaseRecord] = {}
        self.pool: dict[str, ScoredGroup] = {}
        self.served: dict[int, AssembledBatch] = {}
        self.version_ranges: dict[str, tuple[int, int] | None] = {}  # pool group -> its (oldest, newest) token
        self.committed_batch = 0
        self.source_saved: dict[str, Any] | None = None  # the source's state at the last checkpoint

    # ----------------------------------------------------------------------------------------- leases
    def add_guests(self, groups: list[PromptGroup]) -> int:
        """Queue another role's groups (`PromptGroup.owner`) to lease ahead of training prompts; a group already
        queued or in flight is not queued again (its owner, restarted, hands its pending groups over again).
        Returns how many were queued."""
        held = {group.group_id for group in self.guest_queue} | set(self.in_flight)
        new = [group for group in groups if group.group_id not in held]
        self.guest_queue.extend(new)
        return len(new)

    def lease(self, worker_id: str, max_groups: int, *, training: bool = True, weights_version: int | None = None,
              max_samples: int | None = None) -> tuple[str, list[PromptGroup]] | None:
        """Up to `max_groups` groups of at most `max_samples` samples together (the first whatever its size):
        other roles' groups first (those the worker's weights can serve: `take_guest_groups`), then, unless
        `training` is off (the worker's weights are too old for training samples), re-issues, then new prompts
        while admitted."""
        self.expire_leases()
        room = float("inf") if max_samples is None else max_samples
        groups = take_guest_groups(self.guest_queue, max_groups, weights_version, room)
        if not training:
            max_groups = len(groups)

        def fits(size: int) -> bool:
            return len(groups) < max_groups and (not groups or sum(g.n_samples for g in groups) + size <= room)

        while self.reissue and fits(self.reissue[0].n_samples):
            groups.append(self.reissue.popleft())
            self.stats.reissued += 1
        new_groups = []
        # The window moves with consumption, not with the version: a step that skipped its update (a NaN, or a batch
        # with no trained token) consumed its batch but left the version where it was, and a synchronous run would
        # otherwise never admit the groups of the next batch. Staleness stays bounded by the check at consumption.
        window = max(self.learner_version, self.trained_batches)
        allowance = self.admission.capacity(learner_version=window, started_groups=self.live_started)
        while allowance > 0 and fits(self.n_samples):
            group = self._next_prompt_group()
            if group is None:  # a user's source with nothing now: asked again at the next lease
                break
            groups.append(group)
            new_groups.append(group)
            allowance -= 1
            self.live_started += 1
            self.stats.started += 1
        if not groups:
            return None
        lease_id = uuid.uuid4().hex[:12]
        self.leases[lease_id] = LeaseRecord(lease_id, worker_id, set(), self.clock() + self.lease_timeout)
        for group in groups:
            self._assign(group, lease_id)
            if group.owner is None:
                self.prompt_groups[group.group_id] = group
        own = [g for g in groups if g.owner is None]
        if self.log is not None and own:
            cursor = self.source.cursor
            self.log.append("lease", lease_id=lease_id, worker_id=worker_id, groups=[encode(g) for g in own],
                            new=[g.group_id for g in new_groups], cursor=[cursor.epoch, cursor.position])
        return lease_id, groups

    def _assign(self, group: PromptGroup, lease_id: str) -> None:
        """Put `group` in flight under `lease_id`, taking it out of any lease that held it before."""
        self._forget_in_flight(group.group_id)
        self.in_flight[group.group_id] = (group, lease_id)
        self.leases[lease_id].group_ids.add(group.group_id)

    def _next_prompt_group(self) -> PromptGroup | None:
        drawn = self.source.next()
        if drawn is None:
            return None
        record, cursor = drawn
        return PromptGroup(group_id=f"{cursor.epoch}:{cursor.position - 1}", prompt=record.prompt,
                           label=record.label, metadata=record.metadata, tools=record.tools, n_samples=self.n_samples,
                           data_index=record.data_index, images=record.images)

    def renew(self, lease_id: str) -> bool:
        record = self.leases.get(lease_id)
        if record is None:
            return False
        record.expires_at = self.clock() + self.lease_timeout
        return True

    def expire_leases(self) -> list[str]:
        now = self.clock()
        expired = [lease_id for lease_id, r in self.leases.items() if r.expires_at <= now]
        return [gid for lease_id in expired for gid in self._revoke(lease_id, "lease_expired")]

    def worker_gone(self, worker_id: str) -> list[str]:
        """Re-issue at once what a dead worker held, instead of waiting for its leases to expire."""
        return self._revoke_worker(worker_id, "worker_died", restored_only=False)

    def worker_started(self, worker_id: str) -> list[str]:
        """Re-issue at once the restored leases of a worker that just (re)started: a new process holds none of them
        (a whole run restarted from its log), and they would otherwise wait out their timeout."""
        return self._revoke_worker(worker_id, "worker_restarted", restored_only=True)

    def groups_lost(self, lost: list[tuple[str, str]], reason: str = "reward_worker_died") -> list[str]:
        """Re-issue the (lease id, group id) pairs still in flight under that lease: work that died with a reward
        worker, which holds no lease the buffer could see expire."""
        reissued = [group_id for lease_id, group_id in lost if self._take_back(lease_id, group_id)]
        self.stats.ignored[f"revoked.{reason}"] += len(reissued)
        return reissued

    def _revoke_worker(self, worker_id: str, reason: str, *, restored_only: bool) -> list[str]:
        mine = [k for k, r in self.leases.items() if r.worker_id == worker_id and (r.restored or not restored_only)]
        return [gid for lease_id in mine for gid in self._revoke(lease_id, reason)]

    def _revoke(self, lease_id: str, reason: str) -> list[str]:
        record = self.leases.pop(lease_id)
        reissued = [group_id for group_id in sorted(record.group_ids) if self._take_back(lease_id, group_id)]
        self.stats.ignored[f"revoked.{reason}"] += len(reissued)
        return reissued

    def _take_back(self, lease_id: str, group_id: str) -> bool:
        """Queue `group_id` for re-issue if it is still in flight under `lease_id` (not scored meanwhile, not leased
        again elsewhere)."""
        entry = self.in_flight.get(group_id)
        if entry is None or entry[1] != lease_id:
            return False
        group, _ = self.in_flight.pop(group_id)
        record = self.leases.get(lease_id)
        if record is not None:
            record.group_ids.discard(group_id)
            if not record.group_ids:
                del self.leases[lease_id]
        (self.reissue if group.owner is None else self.guest_queue).append(group)
        return True

    # ------------------------------------------------------------------------------------------ results
    def accept(self, scored: ScoredGroup) -> str:
        """Take a scored group back. Returns "accepted", "adopted" (this policy's turns in another policy's
        episode), "guest" (another role's group: hand it back to its owner), "dropped.<reason>" or
        "ignored.<reason>"."""
        if scored.host_group is not None:
            return self._adopt(scored)
        entry = self.in_flight.get(scored.group_id)
        if entry is None or entry[1] != scored.lease_id:
            self.stats.ignored["stale_lease"] += 1
            return "ignored.stale_lease"
        group, lease_id = self.in_flight.pop(scored.group_id)
        record = self.leases.get(lease_id)
        if record is not None:
            record.group_ids.discard(scored.group_id)
            if not record.group_ids:
                del self.leases[lease_id]
        if group.owner is not None:
            self.guest_owners[scored.group_id] = group.owner
            return "guest"
        return self._take(scored)

    def _adopt(self, scored: ScoredGroup) -> str:
        """A group no lease of ours gave out: it starts here, as if leased and scored at once, and trains like the
        groups of our prompts; nobody can generate it again, so staleness drops it rather than re-issuing it."""
        if scored.group_id in self.adopted:
            self.stats.ignored["adopted_again"] += 1
            return "ignored.adopted_again"
        first = scored.samples[0] if scored.samples else None
        group = PromptGroup(group_id=scored.group_id, prompt="" if first is None else first.prompt,
                            label=None if first is None else first.label, n_samples=self.n_samples)
        self.adopted.add(scored.group_id)
        self.prompt_groups[scored.group_id] = group
        self.live_started += 1
        self.stats.started += 1
        if self.log is not None:
            self.log.append("adopt", group_id=scored.group_id, group=encode(group))
        outcome = self._take(scored)
        return "adopted" if outcome == "accepted" else outcome

    def _take(self, scored: ScoredGroup) -> str:
        """Admit a scored group of ours into the pool, or drop it (counted and logged)."""
        trained, reason = self._admitted(scored)
        if reason is not None:
            self._drop(scored.group_id, reason)
            return f"dropped.{reason}"
        kept = {sample.sample_id for sample in trained.samples}
        left_out = [sample for sample in scored.samples if sample.sample_id not in kept]
        self.version_ranges.pop(scored.group_id, None)  # a re-issued group comes back with new tokens
        self.pool[scored.group_id] = trained
        self.stats.accepted += 1
        self.stats.left_out_samples += count_episodes(left_out)
        if self.log is not None:
            self.log.append("accept", group_id=scored.group_id, group=encode(trained),
                            **({"left_out": [left_out_entry(sample) for sample in left_out]} if left_out else {}))
        return "accepted"

    def _admitted(self, scored: ScoredGroup) -> tuple[ScoredGroup, str | None]:
        """The group as it trains (failed episodes left out, `--failed-sample-policy`), or why it is dropped. A
        group is whole when it holds its `n_samples` episodes, each with all its segments (`bus.episodes`)."""
        if group_problem(scored.samples, self.n_samples) is not None:
            return scored, "incomplete_group"
        kept = samples_to_train(scored.samples, self.failed_sample_policy, failed)
        if kept is None:
            return scored, "failed_samples"
        if len(kept) < len(scored.samples):
            scored = msgspec.structs.replace(scored, samples=kept)
        return scored, self._drop_reason(scored)

    def _drop_reason(self, scored: ScoredGroup) -> str | None:
        # The gate of the reward: what it admits has a finite one (a sample without one is left out or drops its
        # group above), so the learner trains on each sample's reward as it is.
        if not all(np.isfinite(s.reward) for s in scored.samples):
            return "non_finite_reward"
        if self.group_filter is not None:
            return self.group_filter(scored)
        return None

    def _drop(self, group_id: str, reason: str) -> None:
        self.live_started -= 1
        self.prompt_groups.pop(group_id, None)
        self.stats.dropped[reason] += 1
        if self.log is not None:
            self.log.append("drop", group_id=group_id, reason=reason)

    # ------------------------------------------------------------------------------------------ batches
    def note_version(self, *, step: int, version: int) -> None:
        """The learner finished `step` at `version` (its announcement): admission moves, a prefetch learns its
        version. A batch served ahead of this step was measured against the version the step was to leave; a
        skipped update kept the old one, which that batch trains at, so it is measured again (the learner does
        the same with its copy)."""
        self.announced = (step, version)
        self.learner_version = max(self.learner_version, version)
        self.trained_batches = max(self.trained_batches, step)
        ahead = self.served.get(step + 1)
        if ahead is not None and ahead.learner_version != version:
            ahead.learner_version = version
            ahead.staleness = [s for g in ahead.groups for s in group_staleness(g, version)]
            if self.log is not None:
                self.log.append("remeasure", batch_id=ahead.batch_id, staleness=ahead.staleness,
                                learner_version=version)

    def trains_at(self, *, learner_version: int, trained_batch: int, ahead: bool) -> int:
        """The version the requested batch will be trained at. A prefetch (`ahead`) is asked while the step of
        batch `trained_batch` runs: that step will leave learner_version + 1, unless its announcement already
        said otherwise (a skipped update leaves the version where it was)."""
        if not ahead:
            return learner_version
        step, version = self.announced
        return version if step == trained_batch else learner_version + 1

    def next_batch(self, *, learner_version: int, trained_batch: int, checkpointed_batch: int,
                   ahead: bool = False) -> AssembledBatch | None:
        """The batch the learner trains next (trained_batch + 1), or None until enough groups are scored.

        A prefetch (`ahead`) is measured against the version it will be trained at, but moves admission only as
        far as the steps actually finished: the engines do not have the next weights yet, and groups started early
        against them would come out one version too stale.
        """
        trains_at = self.trains_at(learner_version=learner_version, trained_batch=trained_batch, ahead=ahead)
        if ahead:
            self.learner_version = max(self.learner_version, learner_version)
            self.trained_batches = max(self.trained_batches, trained_batch - 1)
        else:
            self.learner_version = learner_version
            self.trained_batches = max(self.trained_batches, trained_batch)
            self.announced = (trained_batch, learner_version)
        self.commit_through(checkpointed_batch)
        wanted = trained_batch + 1
        if wanted <= self.committed_batch:
            raise BatchOrderError(f"learner asked for batch {wanted}, but batches up to {self.committed_batch} are "
                             f"already committed by a checkpoint; is it resuming from an old checkpoint?")
        if wanted in self.served:
            batch = self.served[wanted]
            batch.replayed = True
            return batch
        if wanted != max(self.served, default=self.committed_batch) + 1:
            raise BatchOrderError(f"learner asked for batch {wanted}; the next new batch is "
                             f"{max(self.served, default=self.committed_batch) + 1}")
        self._evict_stale(trains_at)
        if len(self.pool) < self.admission.groups_per_batch:
            return None
        # In the order the groups were first leased, not the order they finished: which worker was faster must not
        # change the batch, or two runs with the same seed would train the same groups in a different order.
        started = {group_id: index for index, group_id in enumerate(self.prompt_groups)}
        chosen = [self.pool.pop(gid) for gid in sorted(self._choose(wanted), key=started.__getitem__)]
        staleness = [s for g in chosen for s in group_staleness(g, trains_at)]
        batch = AssembledBatch(batch_id=wanted, groups=chosen, staleness=staleness, learner_version=trains_at)
        self.served[wanted] = batch
        self.stats.trained_groups += len(chosen)
        if self.log is not None:
            self.log.append("batch", batch_id=wanted, group_ids=[g.group_id for g in chosen], staleness=staleness,
                            learner_version=trains_at, sync=True)
        return batch

    def _choose(self, batch_id: int) -> list[str]:
        """The batch's group ids: the selector's picks (when one is set), then the oldest groups for the rest."""
        picked = self._selected(batch_id) if self.batch_selector is not None else []
        taken = set(picked)
        rest = [gid for gid in self.pool if gid not in taken]
        return picked + rest[: self.admission.groups_per_batch - len(picked)]

    def _selected(self, batch_id: int) -> list[str]:
        """The selector's picks, checked; a bad answer is counted and reported, never fatal: the batch then
        forms oldest-first, as it would without a selector."""
        try:
            picked = self.batch_selector(list(self.pool.values()), self.admission.groups_per_batch, batch_id)
            return checked_selection(picked, self.pool, self.admission.groups_per_batch)
        except SelectionError as error:
            reason, problem = error.reason, str(error)
        except Exception as error:  # a user's plugin: whatever it raises, the run goes on
            reason, problem = "raised", f"raised {type(error).__name__}: {error}"
        self.stats.selection_fallbacks[reason] += 1
        name = getattr(self.batch_selector, "__name__", repr(self.batch_selector))
        self.on_selection_error(f"batch selector {name}: {problem}; batch {batch_id} taken oldest-first")
        return []

    def _evict_stale(self, trains_at: int) -> None:
        """Consumption re-check: a group whose oldest token is past the bound at the version the batch trains at
        is regenerated, not trained."""
        for group_id in [gid for gid in self.version_ranges if gid not in self.pool]:
            del self.version_ranges[group_id]
        for group_id, scored in list(self.pool.items()):
            if group_id not in self.version_ranges:
                self.version_ranges[group_id] = version_range(sample.token_versions for sample in scored.samples)
            staleness = staleness_of_range(trains_at, self.version_ranges[group_id])
            if staleness > self.admission.max_staleness:
                del self.pool[group_id]
                if group_id in self.adopted:  # another policy's episode made it: nothing here can make it again
                    self._drop(group_id, "stale_adopted")
                    continue
                group = self.prompt_groups[group_id]
                self.reissue.append(group)
                self.stats.dropped["stale_evicted"] += 1
                if self.log is not None:
                    self.log.append("evict", group_id=group_id, group=encode(group), staleness=staleness)

    def commit_through(self, checkpointed_batch: int) -> None:
        """Forget the batches a learner checkpoint covers; a source with state of its own saves it there, at slime's
        rollout id of the checkpoint's last batch (batch k is rollout k - 1), and the log says where."""
        saved = self.source.save(checkpointed_batch - 1) if checkpointed_batch > self.committed_batch else None
        if saved is not None:
            self.source_saved = saved
            if self.log is not None:
                self.log.append("source_saved", saved=saved, sync=True)
        for batch_id in sorted(b for b in self.served if b <= checkpointed_batch):
            for group in self.served.pop(batch_id).groups:
                self.prompt_groups.pop(group.group_id, None)
            if self.log is not None:
                self.log.append("commit", batch_id=batch_id, sync=True)
        self.committed_batch = max(self.committed_batch, checkpointed_batch)
        if self.log is not None and self._compaction_pays(self.log):
            self.log.compact(self.snapshot())
            self.compacted_bytes = self.log.size()

    def _compaction_pays(self, log: BufferLog) -> bool:
        """Past the size, and doubled since the last compaction. Batches served stay in the snapshot until a learner
        checkpoint commits them, so it can be as large as the log: compacting at every batch request would then
        rewrite and archive the whole state each time (gigabytes a minute, each with its fsyncs). Doubling keeps
        the rewriting proportional to what the log took in."""
        return bool(self.compact_log_bytes) and log.size() > max(self.compact_log_bytes, 2 * self.compacted_bytes)

    def snapshot(self) -> dict[str, Any]:
        """Everything `restore` rebuilds, as one log record (other roles' groups are not kept, as in the log)."""
        cursor = self.source.cursor
        stats = self.stats
        return {
            "cursor": [cursor.epoch, cursor.position],
            "counters": {"started": stats.started, "accepted": stats.accepted, "trained_groups": stats.trained_groups,
                         "reissued": stats.reissued, "left_out_samples": stats.left_out_samples,
                         "dropped": dict(stats.dropped), "ignored": dict(stats.ignored),
                         "live_started": self.live_started, "committed_batch": self.committed_batch},
            "prompt_groups": [encode(g) for g in self.prompt_groups.values()],
            "leases": [{"lease_id": r.lease_id, "worker_id": r.worker_id,
                        "group_ids": sorted(g for g, (_, held_by) in self.in_flight.items()
                                            if held_by == r.lease_id and g in self.prompt_groups)}
                       for r in self.leases.values()],
            "reissue": [g.group_id for g in self.reissue],
            "pool": [encode(g) for g in self.pool.values()],
            "served": [{"batch_id": b.batch_id, "groups": [encode(g) for g in b.groups], "staleness": b.staleness,
                        "learner_version": b.learner_version} for b in self.served.values()],
            "adopted": sorted(self.adopted),
            "source_saved": self.source_saved,
        }

    def _restore_snapshot(self, record: dict[str, Any]) -> Cursor:
        counters = record["counters"]
        self.stats = BufferStats(started=counters["started"], accepted=counters["accepted"],
                                 trained_groups=counters["trained_groups"], dropped=Counter(counters["dropped"]),
                                 reissued=counters["reissued"], ignored=Counter(counters["ignored"]),
                                 left_out_samples=counters.get("left_out_samples", 0))
        self.live_started = counters["live_started"]
        self.committed_batch = counters["committed_batch"]
        self.prompt_groups = {g.group_id: g for g in map(decode, record["prompt_groups"])}
        self.leases, self.in_flight = {}, {}
        for lease in record["leases"]:
            self.leases[lease["lease_id"]] = LeaseRecord(lease["lease_id"], lease["worker_id"], set(),
                                                         self.clock() + self.lease_timeout, restored=True)
            for group_id in lease["group_ids"]:
                self._assign(self.prompt_groups[group_id], lease["lease_id"])
        self.leases = {lease_id: r for lease_id, r in self.leases.items() if r.group_ids}
        self.reissue = deque(self.prompt_groups[group_id] for group_id in record["reissue"])
        self.pool = {g.group_id: g for g in map(decode, record["pool"])}
        self.adopted = set(record.get("adopted", ()))
        self.source_saved = record.get("source_saved")
        self.served = {b["batch_id"]: AssembledBatch(b["batch_id"], [decode(g) for g in b["groups"]],
                                                     list(b["staleness"]), b.get("learner_version", 0))
                       for b in record["served"]}
        return Cursor(*record["cursor"])

    # ---------------------------------------------------------------------------------------- recovery
    def restore(self, log_path: str | Path) -> dict[str, int]:
        """Rebuild state from a durable log written by an earlier incarnation of this buffer."""
        replayed = Counter()
        cursor: Cursor | None = None
        for record in BufferLog.replay(Path(log_path)):
            kind = record["kind"]
            replayed[kind] += 1
            if kind == "snapshot":
                cursor = self._restore_snapshot(record)
            elif kind == "lease":
                self.leases.setdefault(record["lease_id"], LeaseRecord(
                    record["lease_id"], record["worker_id"], set(), self.clock() + self.lease_timeout, restored=True))
                for raw in record["groups"]:
                    group = decode(raw)
                    self.prompt_groups[group.group_id] = group
                    self.reissue = deque(g for g in self.reissue if g.group_id != group.group_id)
                    self._assign(group, record["lease_id"])
                self.live_started += len(record["new"])
                self.stats.started += len(record["new"])
                cursor = Cursor(*record["cursor"])
            elif kind == "accept":
                self._forget_in_flight(record["group_id"])
                self.version_ranges.pop(record["group_id"], None)
                self.pool[record["group_id"]] = decode(record["group"])
                self.stats.accepted += 1
                self.stats.left_out_samples += left_out_episodes(record.get("left_out", ()))
            elif kind == "adopt":
                self.adopted.add(record["group_id"])
                self.prompt_groups[record["group_id"]] = decode(record["group"])
                self.live_started += 1
                self.stats.started += 1
            elif kind == "drop":
                self._forget_in_flight(record["group_id"])
                self.pool.pop(record["group_id"], None)  # an adopted group dropped as stale was in the pool
                self.prompt_groups.pop(record["group_id"], None)
                self.live_started -= 1
                self.stats.dropped[record["reason"]] += 1
            elif kind == "evict":
                self.pool.pop(record["group_id"], None)
                self.reissue.append(decode(record["group"]))
            elif kind == "batch":
                groups = [self.pool.pop(gid) for gid in record["group_ids"]]
                self.served[record["batch_id"]] = _replayed_batch(record, groups)
                self.stats.trained_groups += len(groups)
            elif kind == "remeasure" and record["batch_id"] in self.served:
                batch = self.served[record["batch_id"]]
                batch.staleness, batch.learner_version = list(record["staleness"]), record["learner_version"]
            elif kind == "source_saved":
                self.source_saved = record["saved"]
            elif kind == "commit":
                for group in self.served.pop(record["batch_id"], AssembledBatch(0, [], [])).groups:
                    self.prompt_groups.pop(group.group_id, None)
                self.committed_batch = max(self.committed_batch, record["batch_id"])
        # A re-issued group may have been leased again after its eviction: keep one copy in flight.
        self.reissue = deque(g for g in self.reissue if g.group_id not in self.in_flight)
        if cursor is not None:
            self.source.seek(cursor, self.source_saved)
        return dict(replayed)

    def _forget_in_flight(self, group_id: str) -> None:
        entry = self.in_flight.pop(group_id, None)
        record = None if entry is None else self.leases.get(entry[1])
        if record is not None:
            record.group_ids.discard(group_id)
            if not record.group_ids:
                del self.leases[entry[1]]


def _replayed_batch(record: dict[str, Any], groups: list[ScoredGroup]) -> AssembledBatch:
    """A logged batch as it was first served, staleness and version included (older logs had neither)."""
    return AssembledBatch(record["batch_id"], groups, list(record.get("staleness", [])),
                          record.get("learner_version", 0))
