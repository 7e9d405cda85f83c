"""The reward on its way to the optimizer: the buffer admits only finite rewards, an RL step trains on the reward
each sample has (never a stand-in for a missing one), and an SFT step, which learns labels, needs none."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from actors.config import build_config
from actors.learner.stages import to_step_batch
from actors.learner.step import TrainingStep
from actors.learner.trainer_factory import build_trainer
from bus.schema import Sample
from tests.actors.test_failed_samples import answered, core
from tests.support.inprocess import use_spec
from tools.sim.pipeline import SimSpec

pytestmark = pytest.mark.unit


def _sample(index: int, reward: float | None) -> Sample:
    return Sample(sample_id=f"g/{index}", group_id="g", index=index, prompt="p", prompt_tokens=2,
                  tokens=np.arange(5, dtype=np.int32), response="xyz", response_length=3, reward=reward,
                  rollout_log_probs=np.zeros(3, np.float32), status="completed")


def _step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **settings: object) -> TrainingStep:
    use_spec(SimSpec(train_sample_seconds=0.0), tmp_path, monkeypatch)
    config = build_config({"train_backend": "tools.sim.pipeline:sleeping_trainer", "n_samples_per_prompt": 2,
                           **settings})
    return TrainingStep(build_trainer(config), config)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_group_with_a_non_finite_reward_is_dropped_and_never_served(bad: float) -> None:
    buffer = core()
    lease_id, (group, *_) = buffer.lease("w", 1)
    assert buffer.accept(answered(group, lease_id, [1.0, bad, 0.0, 1.0])) == "dropped.non_finite_reward"
    assert buffer.stats.dropped["non_finite_reward"] == 1
    assert buffer.next_batch(learner_version=0, trained_batch=0, checkpointed_batch=0) is None


def test_an_rl_batch_refuses_a_sample_without_a_reward_by_name() -> None:
    with pytest.raises(ValueError, match=r"sample g/1 \(group g\) has no reward"):
        to_step_batch([_sample(0, 1.0), _sample(1, None)], rewarded=True)
    assert [s.reward for s in to_step_batch([_sample(0, 1.0), _sample(1, 0.0)], rewarded=True).samples] == [1.0, 0.0]


def test_an_rl_step_on_a_sample_without_a_reward_trains_nothing(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """It used to train that sample as rewarded 0; the buffer never serves one, so a batch that has it came
    around the buffer (a recording not written by a run) and is refused before any update."""
    step = _step(tmp_path, monkeypatch)
    with pytest.raises(ValueError, match="has no reward"):
        step.train([_sample(0, 1.0), _sample(1, None)], staleness=[0, 0])
    assert step.trainer.version == 0


def test_a_non_finite_reward_that_came_around_the_buffer_never_reaches_the_optimizer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    step = _step(tmp_path, monkeypatch)
    with pytest.raises(ValueError, match="rewards: non-finite value nan"):
        step.train([_sample(0, 1.0), _sample(1, math.nan)], staleness=[0, 0])
    assert step.trainer.version == 0


def test_an_sft_step_trains_samples_that_no_reward_worker_scored(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    step = _step(tmp_path, monkeypatch, loss_type="sft")
    report = step.train([_sample(0, None), _sample(1, None)], staleness=[0, 0])
    assert step.trainer.version == 1 and not report.result.skipped
    assert math.isnan(report.metrics["rollout/reward_mean"])  # no rewards to report, rather than a mean of 0
    scored = step.train([_sample(0, 1.0), _sample(1, 0.0)], staleness=[0, 0])  # a run's SFT samples are scored
    assert scored.metrics["rollout/reward_mean"] == 0.5
