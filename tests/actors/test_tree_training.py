"""An episode that forked into segments (#58) trains as one episode wherever a group's samples are counted: the
buffer's completeness check and failed-sample rule, the batch's left-out count, the run's certificate, the reward
worker (one call per episode, each segment carries its reward), the group baseline (an episode counts once, each
segment gets its advantage), the optimizer steps a batch is cut into, and the batch's metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from actors.buffer.accounting import prompt_verdict
from actors.buffer.log import BufferLog
from actors.learner.stages import add_advantages, mini_batches, to_step_batch
from actors.learner.step import rollout_metrics
from bus.schema import Batch, BatchRequest, PromptGroup, Sample, ScoredGroup
from engines.training.base import DataParallel
from policies.config import PolicyLossConfig
from tests.actors.test_buffer_core import _buffer_actor
from tests.actors.test_failed_samples import FAILED, core
from tests.actors.test_reward_failures import _worker
from tests.support import reward_plugins

ONE = DataParallel(rank=0, size=1)


def segment(group: PromptGroup | str, index: int, number: int = 0, of: int = 1, *, reward: float | None = 1.0,
            parent: int | None = None, final: bool | None = None, failed: bool = False, length: int = 3,
            messages: list[dict[str, Any]] | None = None) -> Sample:
    """Segment `number` of `of` of episode `index` (forked from `parent`, segment 0 by default); the last one ends
    the episode unless `final` says otherwise."""
    group_id = group if isinstance(group, str) else group.group_id
    return Sample(
        sample_id=f"{group_id}/{index}" + (f".{number}" if number else ""), group_id=group_id, index=index,
        prompt="p", prompt_tokens=2, tokens=np.arange(2 + length, dtype=np.int32), response="7" * length,
        response_length=length, reward=None if failed else reward, loss_mask=np.ones(length, dtype=np.int8),
        rollout_log_probs=np.full(length, -1.0, np.float32), token_versions=np.zeros(length, np.int32),
        status="failed" if failed else "completed", error=FAILED if failed else None, segment=number,
        parent_segment=None if number == 0 else (0 if parent is None else parent), segments=of,
        ends_episode=number == of - 1 if final is None else final, metadata={"turns": 1}, messages=messages)


def forked(group: PromptGroup | str, index: int, of: int, **kwargs: Any) -> list[Sample]:
    return [segment(group, index, number, of, **kwargs) for number in range(of)]


def scored_group(group: PromptGroup, lease_id: str, samples: list[Sample]) -> ScoredGroup:
    return ScoredGroup(lease_id=lease_id, group_id=group.group_id, samples=samples, worker_id="w")


@pytest.mark.unit
def test_a_sample_says_where_it_sits_in_its_episode_and_a_broken_link_is_refused() -> None:
    assert segment("g", 0, 2, 3).parent_segment == 0
    for number, of, parent, problem in [(1, 1, 0, "outside 0..segments-1"), (1, 3, None, "forked from an earlier"),
                                        (2, 3, 2, "forked from an earlier"), (0, 2, 0, "segment 0 has none")]:
        with pytest.raises(ValueError, match=problem):
            msgspec.structs.replace(segment("g", 0), segment=number, segments=of, parent_segment=parent)


@pytest.mark.unit
def test_a_group_whose_episode_forked_is_whole_with_all_its_segments_and_incomplete_without_one() -> None:
    """Its group was dropped as incomplete: 4 samples came back for 2 asked."""
    buffer = core()
    buffer.n_samples = 2
    lease_id, (whole, cut, *_) = buffer.lease("w", 2)
    assert buffer.accept(scored_group(whole, lease_id, [*forked(whole, 0, 3), segment(whole, 1)])) == "accepted"
    assert buffer.accept(scored_group(cut, lease_id, [*forked(cut, 0, 3)[:2], segment(cut, 1)])) == \
        "dropped.incomplete_group"
    batch = buffer.next_batch(learner_version=0, trained_batch=0, checkpointed_batch=0)
    assert batch is not None and [s.sample_id for s in batch.groups[0].samples] == [
        f"{whole.group_id}/0", f"{whole.group_id}/0.1", f"{whole.group_id}/0.2", f"{whole.group_id}/1"]


@pytest.mark.unit
def test_a_failed_episode_is_left_out_whole_and_two_episodes_must_remain_however_many_segments() -> None:
    buffer = core()
    buffer.n_samples = 3
    lease_id, (group, lonely, *_) = buffer.lease("w", 2)
    failing = [segment(group, 0, 0, 2), segment(group, 0, 1, 2, failed=True)]  # its reward failed on the final one
    assert buffer.accept(scored_group(group, lease_id, [*failing, *forked(group, 1, 2), segment(group, 2)])) == \
        "accepted"
    assert [s.sample_id for s in buffer.pool[group.group_id].samples] == [
        f"{group.group_id}/1", f"{group.group_id}/1.1", f"{group.group_id}/2"]
    assert buffer.stats.left_out_samples == 1
    # One episode of three segments is not two episodes: no baseline to train against.
    answers = [*forked(lonely, 0, 3), segment(lonely, 1, failed=True), segment(lonely, 2, failed=True)]
    assert buffer.accept(scored_group(lonely, lease_id, answers)) == "dropped.failed_samples"


@pytest.mark.unit
def test_the_certificate_counts_episodes_asked_trained_and_left_out_and_the_segments_trained(tmp_path: Path) -> None:
    (tmp_path / "buffer").mkdir()
    buffer = core(log=BufferLog(tmp_path / "buffer" / "log.msgpack"))
    lease_id, (group, *_) = buffer.lease("w", 1)
    answers = [*forked(group, 0, 3), segment(group, 1), *forked(group, 2, 2, failed=True), segment(group, 3)]
    assert buffer.accept(scored_group(group, lease_id, answers)) == "accepted"
    assert buffer.next_batch(learner_version=0, trained_batch=0, checkpointed_batch=0) is not None
    buffer.log.close()
    restored = core()
    restored.restore(tmp_path / "buffer" / "log.msgpack")
    assert restored.stats.left_out_samples == 1
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "trained_samples.jsonl").write_text('{"batch_id": 1}\n')
    verdict = prompt_verdict(tmp_path)
    assert verdict["verdict"] == "pass"
    assert verdict["samples"] == {"trained": 3, "left_out": 1, "unaccounted": 0, "trained_segments": 5}


@pytest.mark.integration
async def test_the_batch_counts_the_episodes_it_left_out(tmp_path: Path) -> None:
    buffer = _buffer_actor(tmp_path, rollout_batch_size=1, n_samples_per_prompt=4, eval_prompt_data=[])
    await buffer.on_start()
    try:
        lease_id, (group, *_) = buffer.core.lease("w", 1)
        answers = [*forked(group, 0, 3), segment(group, 1), segment(group, 2, failed=True), segment(group, 3)]
        await buffer.on_scored("w", scored_group(group, lease_id, answers))
        batch = await buffer.on_batch_request("learner-0", BatchRequest(learner_version=0))
        assert isinstance(batch, Batch) and len(batch.samples) == 5 and batch.left_out_samples == 1
        assert buffer.metrics()["buffer.samples_left_out"] == 1
    finally:
        await buffer.on_stop()
        buffer.zmq.destroy(linger=0)


@pytest.mark.unit
async def test_the_reward_is_computed_once_per_episode_on_its_final_segment_and_carried_by_every_segment(
        tmp_path: Path) -> None:
    chats = [[{"role": "user", "content": f"segment {number}"}] for number in range(3)]
    # The main conversation (segment 0) ended the episode after a sub-agent's segment 1 and a compaction's 2.
    episode = [segment("g", 0, number, 3, messages=chats[number], final=number == 0) for number in range(3)]
    samples = [*episode, segment("g", 1, messages=chats[0])]
    samples = [msgspec.structs.replace(s, reward=None) for s in samples]
    reward_plugins.SEEN.clear()
    async with _worker(tmp_path, custom_rm_path="tests.support.reward_plugins:counts_segments") as worker:
        scored = await worker.score_samples(samples)
    assert [inp.messages for inp in reward_plugins.SEEN] == [chats[0], chats[0]]  # the final segments
    assert reward_plugins.SEEN[0].segments == chats and reward_plugins.SEEN[1].segments == [chats[0]]
    assert [s.reward for s in scored] == [3.0, 3.0, 3.0, 1.0]
    async with _worker(tmp_path / "raising", custom_rm_path="tests.support.reward_plugins:always_raises") as worker:
        failed = await worker.score_samples(samples)
    assert [s.status for s in failed] == ["failed"] * 4 and failed[1].error.startswith("reward: raised ValueError")


@pytest.mark.unit
def test_each_segment_trains_with_its_episodes_advantage_over_a_baseline_of_episodes() -> None:
    """GRPO over three episodes rewarded 1, 0, 1 (the first of three segments): the mean is 2/3, not the 4/5 of
    five samples, and all three segments of the first get its advantage."""
    samples = [*forked("g", 0, 3, reward=1.0), segment("g", 1, reward=0.0), segment("g", 2, reward=1.0)]
    batch = to_step_batch(samples, rewarded=True)
    add_advantages(PolicyLossConfig(advantage_estimator="grpo"), batch, ONE)
    centred = torch.tensor([1.0, 0.0, 1.0]) - 2 / 3
    expected = centred / (centred.std() + 1e-6)
    for sample, advantage in zip(batch.samples, expected[[0, 0, 0, 1, 2]], strict=True):
        torch.testing.assert_close(sample.advantages, advantage.expand(3), rtol=1e-5, atol=1e-6)


@pytest.mark.unit
def test_optimizer_steps_take_whole_episodes_and_the_batch_metrics_count_episodes() -> None:
    samples = [*forked("g", 0, 3, reward=1.0), segment("g", 1, reward=0.0), *forked("h", 0, 2, reward=0.0),
               segment("h", 1, reward=0.0)]
    parts = mini_batches(to_step_batch(samples, rewarded=True), 2, ONE)
    assert [part.episode_ids for part in parts] == [["g/0"] * 3 + ["g/1"], ["h/0"] * 2 + ["h/1"]]
    with pytest.raises(ValueError, match="4 samples cannot make 5 optimizer steps"):
        mini_batches(to_step_batch(samples, rewarded=True), 5, ONE)
    metrics = rollout_metrics(samples, [0] * len(samples))
    assert metrics["rollout/reward_mean"] == 0.25 and metrics["rollout/samples"] == 7
    assert metrics["multiturn/segments_per_episode"] == 7 / 4 and metrics["multiturn/turns_mean"] == 7 / 4
