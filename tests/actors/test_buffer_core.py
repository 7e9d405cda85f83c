"""The buffer's rules without sockets: admission, leases, drops, the staleness re-check, exactly-once batches,
recovery from the durable log, and the Buffer actor's final commit (its handler called in-process)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
import numpy as np
import pytest

from actors.buffer.actor import Buffer
from actors.buffer.adoption import AdoptionBound, adopted_waiting
from actors.buffer.core import BufferCore
from actors.buffer.log import BufferLog, archived_logs
from actors.config import build_config
from actors.data.prompts import PromptRecord, PromptSource
from actors.runtime.context import ActorContext
from bus.schema import Ack, FinalCommit, Lease, LeaseRequest, PromptGroup, Sample, ScoredGroup

N = 2  # samples per group
B = 3  # groups per batch


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_core(max_staleness: int = 1, *, log: BufferLog | None = None, clock: Clock | None = None,
              records: int = 50, group_filter=None) -> BufferCore:
    data = [PromptRecord(i, f"{i}+1=", str(i + 1), {}) for i in range(records)]
    return BufferCore(source=PromptSource(data, seed=7), n_samples=N, groups_per_batch=B,
                      max_staleness=max_staleness, lease_timeout=10.0, group_filter=group_filter, log=log,
                      clock=clock or Clock())


def scored(group: PromptGroup, lease_id: str, *, version: int = 0, rewards=(1.0, 0.0), status="completed"):
    samples = []
    for index, reward in enumerate(rewards):
        samples.append(Sample(
            sample_id=f"{group.group_id}/{index}", group_id=group.group_id, index=index, prompt=group.prompt,
            prompt_tokens=2, tokens=np.array([5, 6, 7, 8], dtype=np.int32), response="x", response_length=2,
            label=group.label, reward=reward, loss_mask=np.ones(2, dtype=np.int8),
            rollout_log_probs=np.zeros(2, dtype=np.float32),
            token_versions=np.array([version, version + 1], dtype=np.int32), status=status,
        ))
    return ScoredGroup(lease_id=lease_id, group_id=group.group_id, samples=samples, worker_id="w")


def lease_all(core: BufferCore, worker: str = "w", max_groups: int = 100) -> tuple[str, list[PromptGroup]]:
    leased = core.lease(worker, max_groups)
    assert leased is not None
    return leased


@pytest.mark.unit
def test_synchronous_bound_admits_exactly_one_batch_per_version() -> None:
    core = make_core(max_staleness=0)
    _, groups = lease_all(core)
    assert len(groups) == B
    assert core.lease("w", 100) is None  # nothing more until the learner moves
    core.learner_version = 1
    _, more = lease_all(core)
    assert len(more) == B


@pytest.mark.unit
def test_a_batch_lists_its_groups_in_lease_order_whatever_order_they_finished_in() -> None:
    """Which worker finished first must not reorder a batch: the same seed has to train the same sequence."""
    core = make_core()
    lease_id, groups = lease_all(core, max_groups=B)
    for group in reversed(groups):
        assert core.accept(scored(group, lease_id)) == "accepted"
    batch = core.next_batch(learner_version=0, trained_batch=0, checkpointed_batch=0)
    assert batch is not None and [g.group_id for g in batch.groups] == [g.group_id for g in groups]


@pytest.mark.unit
def test_a_step_that_skipped_its_update_still_opens_the_next_batch_in_a_synchronous_run() -> None:
    """The learner consumed batch 1 but its version stayed 0 (non-finite loss): batch 2 must still be generated."""
    core = make_core(max_staleness=0)
    lease_id, groups = lease_all(core)
    for group in groups:
        result = scored(group, lease_id)
        on_policy = [msgspec.structs.replace(s, token_versions=np.zeros(2, dtype=np.int32)) for s in result.samples]
        assert core.accept(msgspec.structs.replace(result, samples=on_policy)) == "accepted"
    assert core.next_batch(learner_version=0, trained_batch=0, checkpointed_batch=0) is not None
    assert core.next_batch(learner_version=0, trained_batch=1, checkpointed_batch=0) is None  # nothing scored yet
    _, more = lease_all(core)
    assert len(more) == B


@pytest.mark.unit
def test_staleness_bound_admits_eta_plus_one_batches_ahead() -> None:
    core = make_core(max_staleness=2)
    _, groups = lease_all(core)
    assert len(groups) == (2 + 1) * B


@pytest.mark.unit
def test_expired_lease_is_reissued_and_late_result_ignored() -> None:
    clock = Clock()
    core = make_core(clock=clock)
    lease_id, groups = lease_all(core, "slow", max_groups=1)
    clock.now = 11.0
    assert core.expire_leases() == [groups[0].group_id]
    new_lease, again = lease_all(core, "fast", max_groups=1)
    assert again[0].group_id == groups[0].group_id
    assert core.accept(scored(groups[0], lease_id)) == "ignored.stale_lease"
    assert core.accept(scored(again[0], new_lease)) == "accepted"
    assert core.accept(scored(again[0], new_lease)) == "ignored.stale_lease"  # a duplicate delivery
    assert core.stats.accepted == 1


@pytest.mark.unit
def test_renewed_lease_does_not_expire() -> None:
    clock = Clock()
    core = make_core(clock=clock)
    lease_id, _ = lease_all(core, max_groups=1)
    clock.now = 8.0
    assert core.renew(lease_id)
    clock.now = 15.0
    assert core.expire_leases() == []


@pytest.mark.unit
def test_dead_worker_groups_are_reissued_at_once() -> None:
    core = make_core()
    _, groups = lease_all(core, "dead", max_groups=2)
    assert sorted(core.worker_gone("dead")) == sorted(g.group_id for g in groups)
    _, again = lease_all(core, "alive", max_groups=2)
    assert {g.group_id for g in again} == {g.group_id for g in groups}


@pytest.mark.unit
def test_failed_samples_drop_the_group_and_free_admission() -> None:
    core = make_core(max_staleness=0)
    lease_id, groups = lease_all(core)
    outcome = core.accept(scored(groups[0], lease_id, rewards=(1.0, None), status="failed"))
    assert outcome == "dropped.failed_samples"
    assert core.stats.dropped["failed_samples"] == 1
    _, replacement = lease_all(core)
    assert len(replacement) == 1  # the dropped group's slot is started again


@pytest.mark.unit
def test_group_filter_reason_is_counted() -> None:
    core = make_core(group_filter=lambda g: "zero_std" if len({s.reward for s in g.samples}) == 1 else None)
    lease_id, groups = lease_all(core)
    assert core.accept(scored(groups[0], lease_id, rewards=(1.0, 1.0))) == "dropped.zero_std"
    assert core.accept(scored(groups[1], lease_id, rewards=(1.0, 0.0))) == "accepted"
    assert core.stats.dropped == {"zero_std": 1}


@pytest.mark.unit
def test_batch_waits_for_enough_groups_then_reports_staleness() -> None:
    core = make_core(max_staleness=1)
    lease_id, groups = lease_all(core)
    for group in groups[: B - 1]:
        core.accept(scored(group, lease_id, version=0))
    assert core.next_batch(learner_version=1, trained_batch=0, checkpointed_batch=0) is None
    core.accept(scored(groups[B - 1], lease_id, version=0))
    batch = core.next_batch(learner_version=1, trained_batch=0, checkpointed_batch=0)
    assert batch is not None and batch.batch_id == 1 and len(batch.groups) == B
    assert batch.staleness == [1] * (B * N)  # learner version 1 minus the oldest token version 0


@pytest.mark.unit
def test_stale_group_is_released_not_trained() -> None:
    core = make_core(max_staleness=1)
    lease_id, groups = lease_all(core)
    for group in groups[:B]:
        core.accept(scored(group, lease_id, version=0))
    assert core.next_batch(learner_version=2, trained_batch=0, checkpointed_batch=0) is None
    assert core.stats.dropped["stale_evicted"] == B
    _, again = lease_all(core)
    assert {g.group_id for g in groups[:B]} <= {g.group_id for g in again}


@pytest.mark.unit
def test_restarted_learner_gets_the_same_batch_again() -> None:
    core = make_core(max_staleness=2)
    lease_id, groups = lease_all(core)
    for group in groups:
        core.accept(scored(group, lease_id))
    first = core.next_batch(learner_version=0, trained_batch=0, checkpointed_batch=0)
    second = core.next_batch(learner_version=1, trained_batch=1, checkpointed_batch=0)
    assert first is not None and second is not None
    # The learner crashed after batch 2 and resumed from its checkpoint after batch 0: batch 1 again, same groups.
    again = core.next_batch(learner_version=0, trained_batch=0, checkpointed_batch=0)
    assert again is not None and again.replayed
    assert again.staleness == first.staleness and again.learner_version == first.learner_version == 0
    assert [g.group_id for g in again.groups] == [g.group_id for g in first.groups]
    # A checkpoint covering batch 1 commits it; asking for it again is then an error, not a silent retrain.
    core.next_batch(learner_version=1, trained_batch=1, checkpointed_batch=1)
    with pytest.raises(ValueError, match="already committed"):
        core.next_batch(learner_version=0, trained_batch=0, checkpointed_batch=1)


@pytest.mark.unit
def test_restore_from_log_loses_nothing_and_trains_nothing_twice(tmp_path: Path) -> None:
    log_path = tmp_path / "log.msgpack"
    core = make_core(max_staleness=2, log=BufferLog(log_path))
    lease_id, groups = lease_all(core)  # 9 groups in flight
    for group in groups[:5]:
        core.accept(scored(group, lease_id))
    core.accept(scored(groups[5], lease_id, rewards=(1.0, None), status="failed"))
    batch = core.next_batch(learner_version=0, trained_batch=0, checkpointed_batch=0)
    assert batch is not None
    core.log.close()

    revived = make_core(max_staleness=2)
    revived.restore(log_path)
    assert set(revived.pool) == {g.group_id for g in groups[3:5]}  # accepted, not yet in a batch
    assert set(revived.in_flight) == {g.group_id for g in groups[6:]}  # still being generated
    assert revived.stats.dropped["failed_samples"] == 1
    same = revived.next_batch(learner_version=0, trained_batch=0, checkpointed_batch=0)
    assert same is not None and [g.group_id for g in same.groups] == [g.group_id for g in batch.groups]
    # The data cursor continues after the last leased prompt instead of starting over.
    _, fresh = lease_all(revived)
    assert not {g.group_id for g in fresh} & {g.group_id for g in groups}


@pytest.mark.unit
def test_a_batch_replayed_after_a_buffer_restart_keeps_its_staleness_and_version(tmp_path: Path) -> None:
    log_path = tmp_path / "log.msgpack"
    core = make_core(max_staleness=2, log=BufferLog(log_path))
    lease_id, groups = lease_all(core)
    for group in groups[:B]:
        core.accept(scored(group, lease_id, version=0))
    first = core.next_batch(learner_version=2, trained_batch=0, checkpointed_batch=0)
    assert first is not None and first.staleness == [2] * (B * N) and first.learner_version == 2
    core.log.close()

    revived = make_core(max_staleness=2)
    revived.restore(log_path)
    again = revived.next_batch(learner_version=2, trained_batch=0, checkpointed_batch=0)
    assert again is not None and again.replayed
    assert again.staleness == first.staleness and again.learner_version == 2


@pytest.mark.unit
def test_groups_from_weights_newer_than_a_restarted_learner_count_their_distance() -> None:
    # The learner restarted from its checkpoint at version 0 while the pool holds groups generated at versions 2-3
    # by the weights it had published before dying: 3 steps away from its own, so past a bound of 2.
    core = make_core(max_staleness=2)
    lease_id, groups = lease_all(core)
    for group in groups[:B]:
        core.accept(scored(group, lease_id, version=2))
    assert core.next_batch(learner_version=0, trained_batch=0, checkpointed_batch=0) is None
    assert core.stats.dropped["stale_evicted"] == B
    for group in groups[B : 2 * B]:
        core.accept(scored(group, lease_id, version=1))  # tokens at versions 1 and 2: distance 2, within the bound
    batch = core.next_batch(learner_version=0, trained_batch=0, checkpointed_batch=0)
    assert batch is not None and batch.staleness == [2] * (B * N)


@pytest.mark.unit
def test_torn_log_tail_is_ignored(tmp_path: Path) -> None:
    log_path = tmp_path / "log.msgpack"
    core = make_core(log=BufferLog(log_path))
    lease_id, groups = lease_all(core)
    core.accept(scored(groups[0], lease_id))
    core.log.close()
    with open(log_path, "ab") as handle:
        handle.write(b"\x85\xa4kind\xa6accept\xa8grou")  # a record cut short by kill -9
    revived = make_core()
    revived.restore(log_path)
    assert list(revived.pool) == [groups[0].group_id]


@pytest.mark.unit
def test_restore_after_a_re_lease_keeps_one_lease_per_group(tmp_path: Path) -> None:
    clock = Clock()
    log_path = tmp_path / "log.msgpack"
    core = make_core(log=BufferLog(log_path), clock=clock)
    _, groups = lease_all(core, "slow", max_groups=1)
    clock.now = 11.0
    core.expire_leases()
    second_lease, again = lease_all(core, "fast", max_groups=1)
    core.accept(scored(again[0], second_lease))
    core.log.close()

    revived = make_core(clock=clock)
    revived.restore(log_path)
    clock.now = 100.0
    assert revived.expire_leases() == []  # nothing is in flight any more, under either lease
    assert list(revived.pool) == [groups[0].group_id]
    assert not revived.reissue


@pytest.mark.unit
def test_a_worker_that_starts_after_a_restore_gets_its_predecessors_groups_re_issued_at_once(tmp_path: Path) -> None:
    """A whole run restarted from its log: the buffer restores the leases the old rollout worker held, and the new
    process under the same name holds none of them; they used to wait out the lease timeout."""
    log_path = tmp_path / "log.msgpack"
    core = make_core(log=BufferLog(log_path))
    _, held = lease_all(core, "rollout-0-0", max_groups=2)
    core.log.close()

    revived = make_core()
    revived.restore(log_path)
    _, fresh = lease_all(revived, "rollout-0-0", max_groups=1)  # granted by this buffer: kept
    assert sorted(revived.worker_started("rollout-0-0")) == sorted(g.group_id for g in held)
    assert [g.group_id for g in revived.reissue] == sorted(g.group_id for g in held)
    assert fresh[0].group_id in revived.in_flight
    assert revived.worker_started("rollout-0-0") == []


def _state(core: BufferCore) -> dict:
    return {
        "pool": sorted(core.pool), "in_flight": sorted(core.in_flight), "reissue": [g.group_id for g in core.reissue],
        "served": {k: [g.group_id for g in b.groups] for k, b in core.served.items()},
        "prompt_groups": sorted(core.prompt_groups), "committed": core.committed_batch,
        "live_started": core.live_started, "started": core.stats.started, "dropped": dict(core.stats.dropped),
        "leases": sorted((r.worker_id, tuple(sorted(r.group_ids))) for r in core.leases.values()),
        "cursor": core.source.cursor,
    }


@pytest.mark.unit
def test_compacted_log_restores_the_same_state_and_keeps_the_history(tmp_path: Path) -> None:
    def exercise(log_path: Path, compact_bytes: int) -> BufferCore:
        core = make_core(max_staleness=3, log=BufferLog(log_path))
        core.compact_log_bytes = compact_bytes
        lease_id, groups = lease_all(core)
        for group in groups[:7]:
            core.accept(scored(group, lease_id))
        core.accept(scored(groups[7], lease_id, rewards=(1.0, None), status="failed"))
        core.worker_gone("w")  # groups[8:] go to the re-issue queue
        for batch_id in (1, 2):
            assert core.next_batch(learner_version=batch_id - 1, trained_batch=batch_id - 1,
                                   checkpointed_batch=batch_id - 1) is not None
        core.commit_through(1)  # a commit is where compaction may happen
        lease_id, more = lease_all(core, worker="v", max_groups=2)
        core.accept(scored(more[0], lease_id))
        core.log.close()
        return core

    plain = exercise(tmp_path / "plain" / "log.msgpack", compact_bytes=0)
    compacted = exercise(tmp_path / "compacted" / "log.msgpack", compact_bytes=1)
    assert archived_logs(tmp_path / "compacted" / "log.msgpack"), "the log should have been compacted"
    assert not archived_logs(tmp_path / "plain" / "log.msgpack")
    revived_plain, revived_compacted = make_core(max_staleness=3), make_core(max_staleness=3)
    revived_plain.restore(tmp_path / "plain" / "log.msgpack")
    counts = revived_compacted.restore(tmp_path / "compacted" / "log.msgpack")
    assert counts["snapshot"] == 1 and counts.get("accept", 0) < 8, "restore should start from the snapshot"
    # The snapshot holds the live state exactly, including the re-issue queue that a replay of the plain log
    # rebuilds only when the dead worker's lease expires (revocations are not logged).
    assert _state(revived_compacted) == _state(compacted)
    assert {k: v for k, v in _state(revived_plain).items() if k not in ("leases", "reissue", "in_flight")} == {
        k: v for k, v in _state(revived_compacted).items() if k not in ("leases", "reissue", "in_flight")}
    same = revived_compacted.next_batch(learner_version=1, trained_batch=1, checkpointed_batch=1)
    assert same is not None and [g.group_id for g in same.groups] == [g.group_id for g in plain.served[2].groups]


@pytest.mark.unit
def test_a_log_that_only_grows_is_compacted_as_it_doubles_not_at_every_batch_request(tmp_path: Path) -> None:
    """Nothing committed (no learner checkpoint yet): every batch served stays in the snapshot, which is then as
    large as the log, so compacting at every request rewrote and archived the whole state each time."""
    path = tmp_path / "log.msgpack"
    core = make_core(max_staleness=1000, log=BufferLog(path), records=200)
    core.compact_log_bytes = 1
    for batch_id in range(1, 41):
        lease_id, groups = lease_all(core, max_groups=B)
        for group in groups:
            core.accept(scored(group, lease_id))
        for _ in range(3):  # the learner's long-poll asks again as groups arrive
            core.next_batch(learner_version=batch_id - 1, trained_batch=batch_id - 1, checkpointed_batch=0)
    core.log.close()
    assert 1 <= len(archived_logs(path)) <= 8  # ~log2(final size / first snapshot), not one per request (120)
    revived = make_core(max_staleness=1000, records=200)
    revived.restore(path)
    assert sorted(revived.served) == list(range(1, 41))


def _buffer_actor(tmp_path: Path, **run_settings: object) -> Buffer:
    for name in ("train", "eval"):
        rows = [{"input": f"{i}+1=", "label": str(i + 1)} for i in range(2 if name == "eval" else 20)]
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    run = {"prompt_data": str(tmp_path / "train.jsonl"), "eval_prompt_data": ["probe", str(tmp_path / "eval.jsonl")],
           "eval_interval": 100, "num_rollout": 1, "rollout_batch_size": B, "n_samples_per_prompt": N,
           "max_staleness": 1, "final_eval_timeout": 30.0, **run_settings}
    context = ActorContext(actor_id="buffer-0", role="buffer", actor_class="actors.buffer.actor:Buffer", node_rank=0,
                           head_address="tcp://127.0.0.1:1", run_dir=tmp_path / "run", settings={"run": run})
    return Buffer(context)


@pytest.mark.integration
def test_final_commit_commits_the_checkpointed_batches(tmp_path: Path) -> None:
    async def scenario() -> None:
        buffer = _buffer_actor(tmp_path)
        await buffer.on_start()
        core = buffer.core
        lease_id, groups = lease_all(core)
        for group in groups[:B]:
            core.accept(scored(group, lease_id))
        assert core.next_batch(learner_version=0, trained_batch=0, checkpointed_batch=0) is not None
        reply = await buffer.on_final_commit(
            "learner-0", FinalCommit(learner_version=1, trained_batch=1, checkpointed_batch=1))
        assert reply == Ack(ok=True) and core.committed_batch == 1 and not core.served
        await buffer.on_stop()
        buffer.zmq.destroy(linger=0)

    asyncio.run(scenario())


def guest(group_id: str, *, weights_version: int | None = None, owner: str = "evaluator") -> PromptGroup:
    return PromptGroup(group_id=group_id, prompt="1+1=", is_eval=True, owner=owner, weights_version=weights_version)


@pytest.mark.unit
def test_a_guest_group_is_leased_first_never_pooled_and_named_for_its_owner_once_scored() -> None:
    core = make_core(max_staleness=1)
    assert core.add_guests([guest("eval:held:0:0"), guest("eval:held:0:1")]) == 2
    lease_id, groups = core.lease("w", 3)
    assert [g.group_id for g in groups[:2]] == ["eval:held:0:0", "eval:held:0:1"] and groups[2].owner is None
    assert core.accept(scored(groups[0], lease_id)) == "guest"
    assert core.guest_owners == {"eval:held:0:0": "evaluator"} and "eval:held:0:0" not in core.pool
    assert core.accept(scored(groups[2], lease_id)) == "accepted"


@pytest.mark.unit
def test_guest_groups_handed_over_again_are_not_queued_twice_while_queued_or_in_flight() -> None:
    core = make_core(max_staleness=1)
    core.add_guests([guest("eval:held:0:0"), guest("eval:held:0:1")])
    lease_id, groups = core.lease("w", 1)
    assert core.add_guests([guest("eval:held:0:0"), guest("eval:held:0:1"), guest("eval:held:0:2")]) == 1
    assert [g.group_id for g in core.guest_queue] == ["eval:held:0:1", "eval:held:0:2"]
    core.accept(scored(groups[0], lease_id))
    assert core.add_guests([guest("eval:held:0:0")]) == 1  # scored and handed back: its owner asks for it again


@pytest.mark.unit
def test_a_worker_too_old_for_training_gets_only_the_guest_groups_its_weights_serve() -> None:
    core = make_core(max_staleness=1)
    core.add_guests([guest("eval:held:0:0", weights_version=0)])
    _, groups = core.lease("w", 10, training=False, weights_version=0)
    assert [g.group_id for g in groups] == ["eval:held:0:0"]
    assert core.lease("w", 10, training=False, weights_version=0) is None


def generated_at(group: PromptGroup, lease_id: str, version: int) -> ScoredGroup:
    """A group every token of which the weights of `version` produced."""
    group_scored = scored(group, lease_id)
    samples = [msgspec.structs.replace(s, token_versions=np.full(2, version, dtype=np.int32))
               for s in group_scored.samples]
    return msgspec.structs.replace(group_scored, samples=samples)


def admit_and_generate(core: BufferCore, version: int) -> None:
    """Lease every group admission allows; each comes back generated by `version`'s weights."""
    lease_id, groups = lease_all(core)
    for group in groups:
        core.accept(generated_at(group, lease_id, version))


@pytest.mark.unit
def test_a_prefetch_is_measured_at_the_version_its_step_will_leave() -> None:
    """Asked while batch 1 trains at version 0, batch 2 will be trained at version 1, and is measured there."""
    core = make_core(max_staleness=1)
    admit_and_generate(core, 0)
    first = core.next_batch(learner_version=0, trained_batch=0, checkpointed_batch=0)
    assert first is not None and set(first.staleness) == {0}
    second = core.next_batch(learner_version=0, trained_batch=1, checkpointed_batch=0, ahead=True)
    assert second is not None and second.batch_id == 2
    assert set(second.staleness) == {1} and second.learner_version == 1


@pytest.mark.unit
def test_a_prefetch_does_not_admit_groups_for_weights_the_engines_do_not_have_yet() -> None:
    core = make_core(max_staleness=0)
    admit_and_generate(core, 0)
    assert core.next_batch(learner_version=0, trained_batch=0, checkpointed_batch=0) is not None
    assert core.next_batch(learner_version=0, trained_batch=1, checkpointed_batch=0, ahead=True) is None
    assert core.lease("w", 100) is None  # batch 2 must come from version 1's weights: nothing starts before them
    core.note_version(step=1, version=1)
    assert len(lease_all(core)[1]) == B


@pytest.mark.unit
def test_a_prefetch_waiting_on_a_skipped_step_is_measured_at_the_version_that_step_kept() -> None:
    """Step 1 applied no update (version stays 0): its announcement admits batch 2, generated by version 0's
    weights, which a synchronous run may then train at version 0 instead of evicting it as one step stale."""
    core = make_core(max_staleness=0)
    admit_and_generate(core, 0)
    assert core.next_batch(learner_version=0, trained_batch=0, checkpointed_batch=0) is not None
    core.note_version(step=1, version=0)
    admit_and_generate(core, 0)
    batch = core.next_batch(learner_version=0, trained_batch=1, checkpointed_batch=0, ahead=True)
    assert batch is not None and set(batch.staleness) == {0} and core.stats.dropped["stale_evicted"] == 0


@pytest.mark.unit
def test_a_batch_served_ahead_of_a_skipped_step_is_measured_again_and_restored_so(tmp_path: Path) -> None:
    """Batch 2, asked for while step 1 trains at version 2, is measured against 3; the step applies no update and
    announces 2, which batch 2 then trains at: its record, and the log a restarted buffer replays, say so."""
    log_path = tmp_path / "log.msgpack"
    core = make_core(max_staleness=3, log=BufferLog(log_path))
    lease_id, groups = lease_all(core)
    for group in groups[:2 * B]:
        core.accept(scored(group, lease_id, version=0))  # tokens of versions 0 and 1
    assert core.next_batch(learner_version=2, trained_batch=0, checkpointed_batch=0) is not None
    ahead = core.next_batch(learner_version=2, trained_batch=1, checkpointed_batch=0, ahead=True)
    assert ahead is not None and (ahead.learner_version, set(ahead.staleness)) == (3, {3})
    core.note_version(step=1, version=2)
    assert (ahead.learner_version, set(ahead.staleness)) == (2, {2})
    core.log.close()

    revived = make_core(max_staleness=3)
    revived.restore(log_path)
    replayed = revived.next_batch(learner_version=2, trained_batch=1, checkpointed_batch=0)
    assert replayed is not None and replayed.replayed
    assert (replayed.learner_version, set(replayed.staleness)) == (2, {2})


@pytest.mark.unit
def test_a_pinned_group_goes_only_to_a_worker_whose_weights_can_serve_its_version() -> None:
    """A worker whose engine joined during version 2's round holds version 0's weights and gets none until the
    learner's held push lands: it leases training work only (here: none is admitted either)."""
    core = make_core(max_staleness=0)
    lease_all(core)  # every admitted training group is out
    core.add_guests([guest(f"eval:held:{version}:{index}", weights_version=version)
                     for version, index in [(2, 0), (0, 0), (2, 1)]])
    assert core.lease("rollout-0-1", 10, weights_version=0)[1] == [core.in_flight["eval:held:0:0"][0]]
    assert core.lease("rollout-0-1", 10, weights_version=1) is None
    _, served = core.lease("rollout-0-0", 10, weights_version=2)
    assert [g.group_id for g in served] == ["eval:held:2:0", "eval:held:2:1"] and not core.guest_queue


@pytest.mark.unit
def test_groups_lost_with_a_reward_worker_are_reissued_unless_scored_or_moved() -> None:
    core = make_core(max_staleness=1)
    lease_id, groups = lease_all(core, "w", max_groups=3)
    assert core.accept(scored(groups[0], lease_id)) == "accepted"
    lost = [(lease_id, g.group_id) for g in groups] + [("some-other-lease", "0:99")]
    assert core.groups_lost(lost) == [groups[1].group_id, groups[2].group_id]  # the scored one stays accepted
    assert core.groups_lost(lost) == []  # already re-issued: nothing twice
    new_lease, again = lease_all(core, "v", max_groups=2)
    assert [g.group_id for g in again] == [groups[1].group_id, groups[2].group_id]
    assert core.accept(scored(groups[1], lease_id)) == "ignored.stale_lease"  # the lost copy, arriving late
    assert core.accept(scored(again[0], new_lease)) == "accepted"


@pytest.mark.unit
def test_handed_off_groups_are_named_per_reward_worker_and_forgotten_after_the_lease_would_expire() -> None:
    from actors.rollout.handed_off import HandedOff

    now = [0.0]
    handed = HandedOff(keep_s=10.0, clock=lambda: now[0])
    handed.note("reward-0-0", "L1", "0:1")
    handed.note("reward-0-1", "L1", "0:2")
    now[0] = 8.0
    handed.note("reward-0-0", "L2", "0:3")
    now[0] = 12.0
    assert handed.lost_with("reward-0-0") == [("L2", "0:3")]  # 0:1 is past its lease's expiry: the buffer has it
    assert handed.lost_with("reward-0-0") == []
    assert handed.lost_with("reward-0-1") == []


@pytest.mark.unit
def test_a_lease_fills_the_samples_the_worker_has_room_for_one_sample_eval_groups_included() -> None:
    """A worker with 6 free rows: six one-sample eval groups, not the 3 two-sample groups its rows would hold."""
    core = make_core()
    core.add_guests([guest(f"eval:held:0:{index}", weights_version=0) for index in range(8)])
    _, first = core.lease("w", 6, max_samples=6)
    assert [g.owner for g in first] == ["evaluator"] * 6
    _, second = core.lease("w", 6, max_samples=6)  # two eval groups left (2 samples), then training groups of N=2
    assert [g.n_samples for g in second] == [1, 1, N, N]
    _, third = core.lease("w", 6, max_samples=1)  # less room than one training group: the first one still goes
    assert [g.n_samples for g in third] == [N]
    _, unbounded = core.lease("w", 100)  # no bound on samples (slime's data source): the admission's limit only
    assert len(unbounded) == (1 + 1) * B - 3


def adopted(group_id: str, *, version: int = 0) -> ScoredGroup:
    """A group of this policy's turns in another policy's episode, scored: it names that episode's group and lease."""
    turns = PromptGroup(group_id=group_id, prompt="What is 2 + 3?", label="5", n_samples=N)
    return msgspec.structs.replace(scored(turns, "the-hosts-lease", version=version), host_group="0:9")


@pytest.mark.unit
def test_a_group_from_another_policys_episode_is_adopted_once_batched_and_restored_so(tmp_path: Path) -> None:
    log_path = tmp_path / "log.msgpack"
    core = make_core(max_staleness=2, log=BufferLog(log_path))
    lease_id, groups = lease_all(core, max_groups=B - 1)
    started = core.stats.started
    assert core.accept(adopted("0:9@solver.0")) == "adopted"
    assert core.accept(adopted("0:9@solver.0")) == "ignored.adopted_again"  # the host episode generated again
    assert core.stats.started == started + 1 and core.stats.ignored["adopted_again"] == 1
    for group in groups:
        core.accept(scored(group, lease_id))
    batch = core.next_batch(learner_version=0, trained_batch=0, checkpointed_batch=0)
    assert batch is not None
    assert [g.group_id for g in batch.groups] == [*(g.group_id for g in groups), "0:9@solver.0"]
    core.log.close()

    revived = make_core(max_staleness=2)
    revived.restore(log_path)
    assert _state(revived) == _state(core)
    assert revived.accept(adopted("0:9@solver.0")) == "ignored.adopted_again"
    again = revived.next_batch(learner_version=0, trained_batch=0, checkpointed_batch=0)
    assert again is not None and [g.group_id for g in again.groups] == [g.group_id for g in batch.groups]
    revived.log = BufferLog(tmp_path / "compacted.msgpack")
    revived.log.compact(revived.snapshot())
    revived.log.close()
    compacted = make_core(max_staleness=2)
    compacted.restore(tmp_path / "compacted.msgpack")
    assert compacted.accept(adopted("0:9@solver.0")) == "ignored.adopted_again"


@pytest.mark.unit
def test_an_adopted_group_past_the_staleness_bound_is_dropped_not_given_out_again(tmp_path: Path) -> None:
    log_path = tmp_path / "log.msgpack"
    core = make_core(max_staleness=1, log=BufferLog(log_path))
    assert core.accept(adopted("0:9@solver.0", version=0)) == "adopted"
    assert core.next_batch(learner_version=3, trained_batch=0, checkpointed_batch=0) is None
    assert core.stats.dropped["stale_adopted"] == 1 and "0:9@solver.0" not in core.pool
    _, leased = lease_all(core)
    assert "0:9@solver.0" not in {g.group_id for g in leased}  # nobody here can generate it again
    core.log.close()
    revived = make_core(max_staleness=1)
    revived.restore(log_path)
    assert "0:9@solver.0" not in revived.pool and revived.stats.dropped["stale_adopted"] == 1


@pytest.mark.unit
def test_the_adopted_backlog_bound_defaults_to_what_can_train_before_it_goes_stale() -> None:
    def bound(**settings: object) -> AdoptionBound:
        return AdoptionBound.of(build_config({"hf_checkpoint": "m", "rollout_batch_size": 8, **settings}))

    assert bound(max_staleness=1).limit == (1 + 1) * 8
    assert bound(max_staleness=0).limit == 8  # on-policy: one batch
    assert bound(max_adopted_waiting=3).limit == 3
    assert bound(max_adopted_waiting=0).limit is None  # no bound
    with pytest.raises(ValueError, match="max_adopted_waiting"):
        bound(max_adopted_waiting=-1)


@pytest.mark.unit
def test_the_room_for_adopted_groups_shrinks_as_they_wait_grows_as_they_train_and_lifts_after_the_last_batch() -> None:
    core = make_core(max_staleness=3)
    bound = AdoptionBound(limit=2, last_batch=2)
    assert bound.room(core) == 2
    lease_id, groups = lease_all(core, max_groups=B)
    for group in groups:  # the policy's own groups wait too, but do not count
        core.accept(scored(group, lease_id))
    assert core.accept(adopted("0:9@solver.0")) == "adopted"
    assert bound.room(core) == 1 and not bound.over(core, adopted("0:9@solver.1"))
    assert core.accept(adopted("0:9@solver.1")) == "adopted"
    assert bound.room(core) == 0 and adopted_waiting(core) == 2
    assert bound.over(core, adopted("0:9@solver.2")) and not bound.over(core, scored(groups[0], lease_id))
    assert core.next_batch(learner_version=0, trained_batch=0, checkpointed_batch=0) is not None  # the own 3
    assert bound.room(core) == 0
    lease_id, groups = lease_all(core, max_groups=1)
    core.accept(scored(groups[0], lease_id))
    batch = core.next_batch(learner_version=1, trained_batch=1, checkpointed_batch=0)  # the last batch: 2 adopted
    assert batch is not None and {"0:9@solver.0", "0:9@solver.1"} <= {g.group_id for g in batch.groups}
    assert bound.trains_no_more(core) and bound.room(core) is None  # nothing would drain it: no hold-back
    assert AdoptionBound(limit=None, last_batch=9).room(make_core()) is None


@pytest.mark.integration
def test_the_buffer_tells_every_lease_its_room_counts_adoptions_over_it_and_ignores_them_after_its_last_batch(
        tmp_path: Path) -> None:
    """The Buffer actor's handlers called in-process: the room in each lease answer, a lease held back to owned
    groups (an eval round's feeds no policy), an adoption over the bound trained and counted, and after the last
    batch a group of another's episode ignored, counted, not kept."""
    async def scenario() -> None:
        buffer = _buffer_actor(tmp_path, max_adopted_waiting=1, num_rollout=1)
        await buffer.on_start()
        core = buffer.core

        async def lease(max_groups: int, training: bool = True) -> Lease:
            return await buffer.on_lease_request("rollout-0-0", LeaseRequest(worker_id="rollout-0-0",
                                                                             max_groups=max_groups, training=training))
        core.add_guests([guest("eval:probe:0:0")])
        held = await lease(4, training=False)
        assert [g.group_id for g in held.groups] == ["eval:probe:0:0"] and held.adoption_room == 1
        assert (await lease(0, training=False)).groups == []  # nothing owned left: nothing at all
        await buffer.on_scored("reward-0-0", adopted("0:9@solver.0"))
        await buffer.on_scored("reward-0-0", adopted("0:9@solver.1"))  # an episode already running: over the bound
        assert (await lease(0)).adoption_room == 0
        assert buffer.counters["groups.adopted"] == 2 and buffer.counters["groups.adopted_over_bound"] == 1
        assert adopted_waiting(core) == 2
        own = await lease(B - 2)
        for group in own.groups:
            await buffer.on_scored("reward-0-0", scored(group, own.lease_id))
        assert core.next_batch(learner_version=0, trained_batch=0, checkpointed_batch=0) is not None  # num_rollout 1
        await buffer.on_scored("reward-0-0", adopted("0:9@solver.2"))
        assert buffer.counters["groups.ignored.after_last_batch"] == 1 and "0:9@solver.2" not in core.adopted
        assert (await lease(0)).adoption_room is None
        await buffer.on_stop()
        buffer.zmq.destroy(linger=0)

    asyncio.run(scenario())
