"""A group with a failed sample trains on the rest (#58): one episode that raised dropped its whole GRPO group, so
15% failing episodes dropped 48% of the groups. Followed through every seam it crosses: the reward worker scores
the others, the buffer leaves the failed sample out (counted, logged, in the batch), the advantages are normalised
over the samples that remain, and the run's certificate accounts for every sample of a trained group."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from actors.buffer.accounting import prompt_verdict
from actors.buffer.core import BufferCore
from actors.buffer.log import BufferLog
from actors.data.prompts import PromptRecord, PromptSource
from actors.learner.stages import add_advantages, to_step_batch
from actors.rollout.generate import failed_sample
from bus.codec import encode
from bus.schema import Batch, BatchRequest, PromptGroup, Sample, ScoredGroup
from engines.training.base import DataParallel
from policies.config import PolicyLossConfig
from tests.actors.test_buffer_core import Clock, _buffer_actor
from tests.actors.test_reward_failures import _worker
from tests.support.inprocess import use_spec

N = 4  # samples per group
FAILED = "agent pkg.mod:agent failed: RuntimeError: the sandbox is gone"


def core(policy: str = "leave_out", *, log: BufferLog | None = None) -> BufferCore:
    data = [PromptRecord(i, f"{i}+1=", str(i + 1), {}) for i in range(20)]
    return BufferCore(source=PromptSource(data, seed=7), n_samples=N, groups_per_batch=1, max_staleness=1,
                      lease_timeout=10.0, clock=Clock(), log=log, failed_sample_policy=policy)


def answered(group: PromptGroup, lease_id: str, rewards: list[float | None]) -> ScoredGroup:
    """A scored group: a None reward is a sample whose episode failed (no response, no reward)."""
    samples = []
    for index, reward in enumerate(rewards):
        length = 0 if reward is None else 3
        samples.append(Sample(
            sample_id=f"{group.group_id}/{index}", group_id=group.group_id, index=index, prompt=group.prompt,
            prompt_tokens=2, tokens=np.arange(2 + length, dtype=np.int32), response="x" * length,
            response_length=length, label=group.label, reward=reward, loss_mask=np.ones(length, dtype=np.int8),
            rollout_log_probs=np.zeros(length, np.float32), token_versions=np.zeros(length, np.int32),
            status="failed" if reward is None else "completed", error=FAILED if reward is None else None))
    return ScoredGroup(lease_id=lease_id, group_id=group.group_id, samples=samples, worker_id="w")


@pytest.mark.unit
def test_a_failed_sample_is_left_out_and_its_group_trains_on_the_rest_normalised_over_them() -> None:
    buffer = core()
    lease_id, (group, *_) = buffer.lease("w", 1)
    assert buffer.accept(answered(group, lease_id, [1.0, None, 0.0, 1.0])) == "accepted"
    assert buffer.stats.left_out_samples == 1 and not buffer.stats.dropped
    batch = buffer.next_batch(learner_version=0, trained_batch=0, checkpointed_batch=0)
    assert batch is not None
    samples = [sample for kept in batch.groups for sample in kept.samples]
    assert [sample.index for sample in samples] == [0, 2, 3] and len(batch.staleness) == 3
    # GRPO over the three that remain: mean 2/3, unbiased std sqrt(1/3); the failed sample is no baseline of theirs.
    step = to_step_batch(samples, rewarded=True)
    add_advantages(PolicyLossConfig(advantage_estimator="grpo"), step, DataParallel(rank=0, size=1))
    expected = (torch.tensor([1.0, 0.0, 1.0]) - 2 / 3) / (np.sqrt(1 / 3) + 1e-6)
    for sample, advantage in zip(step.samples, expected, strict=True):
        torch.testing.assert_close(sample.advantages, advantage.expand(3), rtol=1e-5, atol=1e-6)


@pytest.mark.unit
@pytest.mark.parametrize(("policy", "rewards", "outcome"), [
    ("leave_out", [1.0, None, None, None], "dropped.failed_samples"),  # one left: no baseline to train against
    ("drop_group", [1.0, None, 0.0, 1.0], "dropped.failed_samples"),  # the behaviour before #58, on request
])
def test_a_group_with_too_few_samples_left_or_under_drop_group_is_dropped(policy: str, rewards: list[float | None],
                                                                          outcome: str) -> None:
    buffer = core(policy)
    lease_id, (group, *_) = buffer.lease("w", 1)
    assert buffer.accept(answered(group, lease_id, rewards)) == outcome
    assert buffer.stats.dropped == {"failed_samples": 1} and buffer.stats.left_out_samples == 0


@pytest.mark.unit
def test_the_certificate_accounts_for_every_sample_of_a_trained_group_left_out_ones_included(tmp_path: Path) -> None:
    (tmp_path / "buffer").mkdir()
    buffer = core(log=BufferLog(tmp_path / "buffer" / "log.msgpack"))
    lease_id, (group, *_) = buffer.lease("w", 1)
    buffer.accept(answered(group, lease_id, [1.0, None, 0.0, None]))
    assert buffer.next_batch(learner_version=0, trained_batch=0, checkpointed_batch=0) is not None
    restored = core()
    restored.restore(tmp_path / "buffer" / "log.msgpack")
    assert restored.stats.left_out_samples == 2
    buffer.log.close()
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "trained_samples.jsonl").write_text('{"batch_id": 1}\n')
    verdict = prompt_verdict(tmp_path)
    assert verdict["verdict"] == "pass" and verdict["fates"] == {"trained": 1}
    assert verdict["samples"] == {"trained": 2, "left_out": 2, "unaccounted": 0, "trained_segments": 2}
    # A log that says nothing of the two it left out: the certificate fails on them.
    unsaid = BufferLog(tmp_path / "buffer" / "log.msgpack")
    unsaid.append("accept", group_id=group.group_id, group=encode(restored.served[1].groups[0]))
    unsaid.close()
    verdict = prompt_verdict(tmp_path)
    assert verdict["verdict"] == "fail" and verdict["samples"] == {"trained": 2, "left_out": 0, "unaccounted": 2,
                                                                    "trained_segments": 2}


@pytest.mark.unit
async def test_the_reward_worker_scores_the_samples_beside_a_failed_one(tmp_path: Path) -> None:
    """It scored none of them when one had failed: the buffer was going to drop the group anyway."""
    group = answered(PromptGroup(group_id="g", prompt="3+4=", label="7"), "l", [0.0, None, 0.0, 0.0]).samples
    group = [sample if sample.status == "failed" else
             Sample(**{**{f: getattr(sample, f) for f in sample.__struct_fields__}, "reward": None,
                       "response": response}) for sample, response in zip(group, ["7", "", "no", "7"], strict=True)]
    async with _worker(tmp_path, rm_type="exact_match") as worker:
        scored = await worker.score_samples(group)
    assert [(s.status, s.reward) for s in scored] == [("completed", 1.0), ("failed", None), ("completed", 0.0),
                                                       ("completed", 1.0)]
    async with _worker(tmp_path / "drop", rm_type="exact_match", failed_sample_policy="drop_group") as worker:
        assert [s.reward for s in await worker.score_samples(group)] == [None] * 4  # not worth scoring


@pytest.mark.integration
async def test_the_batch_says_how_many_samples_of_its_groups_were_left_out(tmp_path: Path) -> None:
    """The learner logs it per step (`rollout/samples_left_out`); the buffer counts it (`buffer.samples_left_out`)."""
    buffer = _buffer_actor(tmp_path, rollout_batch_size=1, n_samples_per_prompt=N, eval_prompt_data=[])
    await buffer.on_start()
    try:
        lease_id, (group, *_) = buffer.core.lease("w", 1)
        await buffer.on_scored("w", answered(group, lease_id, [1.0, 0.0, None, 1.0]))
        batch = await buffer.on_batch_request("learner-0", BatchRequest(learner_version=0))
        assert isinstance(batch, Batch) and len(batch.samples) == 3 and batch.left_out_samples == 1
        assert buffer.metrics()["buffer.samples_left_out"] == 1
    finally:
        await buffer.on_stop()
        buffer.zmq.destroy(linger=0)


async def one_episode_fails(context: Any, group: PromptGroup) -> list[Sample]:
    """A generate plugin whose second episode of every group fails, as an agent that raised does."""
    from actors.plugins import default_generate

    samples = await default_generate(context, group)
    return [failed_sample(group, 1, context.prompt_ids(group.prompt), FAILED) if sample.index == 1 else sample
            for sample in samples]


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_a_run_whose_every_group_has_a_failed_episode_trains_every_group_on_the_rest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Real actors on real sockets (sleeping engine and trainer): no group is dropped, each step trains 2 groups
    of 3 and says it left 2 samples out, and the audit finds every trained sample where the buffer put it."""
    from actors.runtime.metrics import read_metrics
    from tests.actors.test_learner_actor import SPEC, _run_to_the_end, _settings
    from tools.audit_run import audit

    use_spec(SPEC, tmp_path, monkeypatch)
    settings = _settings(tmp_path, n_samples_per_prompt=N, rollout_max_batch_size=2 * N,
                         custom_generate_function_path=f"{__name__}:one_episode_fails")
    seen = await _run_to_the_end(tmp_path, settings)
    assert set(seen["exit_codes"].values()) == {0}  # type: ignore[union-attr]
    steps = read_metrics(tmp_path / "metrics" / "train.jsonl")
    assert [(s["rollout/samples"], s["rollout/samples_left_out"]) for s in steps] == [(6.0, 2.0), (6.0, 2.0)]
    report = audit(tmp_path)
    assert report.ok, report.problems
    verdict = prompt_verdict(tmp_path)
    assert "dropped: failed_samples" not in verdict["fates"] and verdict["samples"]["left_out"] == 4
