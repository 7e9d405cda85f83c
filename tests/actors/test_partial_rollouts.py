"""Samples that span a weight update (slime's partial rollouts) and the batch metrics of multi-turn episodes."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest

from actors.config import build_config
from actors.learner.episode_metrics import episode_metrics
from actors.learner.stages import masked_older_tokens, to_train_sample
from actors.learner.step import TrainingStep
from actors.rollout.trajectory import Trajectory
from bus.schema import PromptGroup, Sample
from engines.training.config import TorchTrainerConfig
from engines.training.torch_trainer import TorchTrainer
from tests.actors.test_slime_flags import configure

GROUP = PromptGroup(group_id="g", prompt="1+1=", label="2", n_samples=2)


def spanning_sample(index: int = 0, reward: float = 1.0) -> Sample:
    """Two model turns around a tool result; a weight update (3 -> 4) landed in the first turn."""
    trajectory = Trajectory([20, 21, 22])
    trajectory.add_model([30, 31, 32], [-1.0, -1.1, -1.2], [3, 3, 4])
    trajectory.add_environment([40, 41])
    trajectory.add_model([33, 34], [-0.5, -0.6], [4, 4])
    sample = trajectory.to_sample(GROUP, index, response="r", status="completed",
                                  metadata={"tool_calls": 1, "tool_errors": 1})
    return msgspec.structs.replace(sample, reward=reward)


@pytest.mark.unit
def test_only_the_newest_weights_tokens_train_when_asked_and_the_tool_tokens_never() -> None:
    sample = spanning_sample()
    assert to_train_sample(sample, rewarded=False).loss_mask.tolist() == [1, 1, 1, 0, 0, 1, 1]
    newest_only = to_train_sample(sample, rewarded=False, newest_version_only=True)
    assert newest_only.loss_mask.tolist() == [0, 0, 1, 0, 0, 1, 1]
    assert masked_older_tokens([sample, sample]) == 4


@pytest.mark.unit
def test_slimes_mask_offpolicy_flag_sets_it() -> None:
    config, _ = configure(["--mask-offpolicy-in-partial-rollout"])
    assert config.learner.mask_offpolicy_in_partial_rollout
    assert not configure([])[0].learner.mask_offpolicy_in_partial_rollout


@pytest.mark.unit
def test_episode_metrics_count_turns_tool_calls_errors_and_samples_spanning_weights() -> None:
    single = Sample(sample_id="g/9", group_id="g", index=9, prompt="p", prompt_tokens=1,
                    tokens=np.asarray([1, 2, 3], dtype=np.int32), response="x", response_length=2, label=None,
                    reward=0.0, loss_mask=np.ones(2, dtype=np.int8),
                    rollout_log_probs=np.zeros(2, dtype=np.float32), token_versions=np.asarray([4, 4], np.int32),
                    status="truncated", metadata={}, error=None)
    metrics = episode_metrics([spanning_sample(0), spanning_sample(1), single])
    assert metrics["partial/mixed_version_fraction"] == pytest.approx(2 / 3)
    assert metrics["multiturn/turns_mean"] == 2 and metrics["multiturn/tool_calls_mean"] == 1
    assert metrics["multiturn/tool_error_fraction"] == 1.0
    assert metrics["multiturn/model_tokens_per_turn"] == 2.5
    assert metrics["multiturn/environment_token_fraction"] == pytest.approx(2 / 7)
    assert metrics["multiturn/truncated_fraction"] == 0.0
    assert set(episode_metrics([single])) == {"partial/mixed_version_fraction"}
    assert "multiturn/turn_reward_mean" not in metrics
    rewarded = msgspec.structs.replace(spanning_sample(), metadata={"turns": 2, "turn_rewards": [1.0, 0.0, 0.5]})
    metrics = episode_metrics([rewarded, spanning_sample(1)])
    assert metrics["multiturn/turn_reward_mean"] == 0.5 and metrics["multiturn/rewarded_turns_per_episode"] == 1.5
    assert metrics["multiturn/undeclared_tool_calls_mean"] == 0.0
    invented = msgspec.structs.replace(spanning_sample(), metadata={"turns": 2, "undeclared_tool_calls": 3})
    assert episode_metrics([invented, spanning_sample(1)])["multiturn/undeclared_tool_calls_mean"] == 1.5


@pytest.mark.integration
def test_the_learner_trains_on_the_newest_weights_tokens_only_when_asked(tiny_model_path: Path) -> None:
    samples = [spanning_sample(0, 1.0), spanning_sample(1, 0.0)]
    trained = {}
    for mask_older in (False, True):
        config = build_config({"hf_checkpoint": str(tiny_model_path), "n_samples_per_prompt": 2,
                               "rollout_batch_size": 1, "mask_offpolicy_in_partial_rollout": mask_older})
        step = TrainingStep(TorchTrainer(TorchTrainerConfig(model_path=tiny_model_path)), config)
        trained[mask_older] = step.train(samples, staleness=[0, 0]).metrics
    assert trained[False]["loss_tokens"] == 10 and "partial/masked_older_tokens" not in trained[False]
    assert trained[True]["loss_tokens"] == 6 and trained[True]["partial/masked_older_tokens"] == 4
