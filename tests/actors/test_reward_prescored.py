"""A reward already set on a sample (a slime rollout function or generate plugin scored it) is kept, as slime's
generate_and_rm keeps it: the real RewardWorker's scoring, called in process (no sockets are opened)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from actors.reward.actor import RewardWorker
from actors.runtime.context import ActorContext
from bus.schema import Sample

LABEL = "7"


def _sample(index: int, response: str, reward: float | None) -> Sample:
    return Sample(sample_id=f"g/{index}", group_id="g", index=index, prompt="3+4=", prompt_tokens=1,
                  tokens=np.array([1, 2], dtype=np.int32), response=response, response_length=1, label=LABEL,
                  reward=reward, loss_mask=np.ones(1, dtype=np.int8), status="completed")


@contextlib.asynccontextmanager
async def _worker(tmp_path: Path, **reward: object) -> AsyncIterator[RewardWorker]:
    """The worker as its process starts it, up to registration (which needs a controller this test has not)."""
    context = ActorContext(actor_id="reward-0-0", role="reward", actor_class="actors.reward.actor:RewardWorker",
                           node_rank=0, head_address="tcp://127.0.0.1:1", run_dir=tmp_path,
                           settings={"run": reward})
    worker = RewardWorker(context)
    try:
        await worker.on_start()
        yield worker
    finally:
        worker.zmq.destroy(linger=0)


@pytest.mark.unit
async def test_group_with_every_reward_set_passes_through_unscored(tmp_path: Path) -> None:
    async with _worker(tmp_path, rm_type="exact_match") as worker:
        scored = await worker.score_samples([_sample(0, "7", 0.25), _sample(1, "no", 0.75)])
        assert [s.reward for s in scored] == [0.25, 0.75]  # exact_match would have given 1.0 and 0.0
        assert worker.counters["samples.prescored"] == 2


@pytest.mark.unit
async def test_per_sample_rm_scores_only_the_samples_without_a_reward(tmp_path: Path) -> None:
    async with _worker(tmp_path, rm_type="exact_match") as worker:
        samples = [_sample(0, "7", 0.25), _sample(1, "7", None), _sample(2, "no", float("nan"))]
        scored = await worker.score_samples(samples)
        assert [s.reward for s in scored] == [0.25, 1.0, 0.0]  # a NaN is no reward: it is scored
        assert [s.sample_id for s in scored] == ["g/0", "g/1", "g/2"]
        assert worker.counters["samples.prescored"] == 1


@pytest.mark.unit
async def test_group_rm_rescores_the_whole_group_when_one_sample_lacks_a_reward(tmp_path: Path) -> None:
    async with _worker(tmp_path, custom_rm_path="examples.slime_style.group_rm:rm", group_rm=True) as worker:
        scored = await worker.score_samples([_sample(0, "7", 0.25), _sample(1, "5", None)])
        assert [s.reward for s in scored] == [1.0, 0.0]  # group_rm's own scores, the preset 0.25 replaced
        assert worker.counters["samples.prescored"] == 0
        kept = await worker.score_samples([_sample(0, "7", 0.25), _sample(1, "5", 0.5)])
        assert [s.reward for s in kept] == [0.25, 0.5]
        assert worker.counters["samples.prescored"] == 2
