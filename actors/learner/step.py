"""One learner step on a batch of samples: a short pipeline of named stages, then one optimizer step.

to typed batch -> this rank's shard -> reference log-probs (when the policy needs them) -> pi_old (when it
differs from the training forward) -> advantages -> loss with the step's global denominators -> the trainer's
step. The stages live in `actors.learner.stages`, the loss in `policies.step_loss`; the trainer gets the batch
and the loss object and never calls back into the learner. Kept apart from the learner actor so it runs (and is
tested) without any socket.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from actors.config import RunConfig
from actors.learner import stages
from bus.schema import Sample
from engines.training.base import StepResult, Trainer
from policies.staleness import staleness_histogram
from policies.step_loss import PiOldSource, pi_old_source


@dataclass
class StepReport:
    result: StepResult
    metrics: dict[str, float]


class TrainingStep:
    def __init__(self, trainer: Trainer, config: RunConfig, *, pi_old: PiOldSource | None = None) -> None:
        """`pi_old` overrides the rule (`policies.step_loss.pi_old_source`); only tests comparing paths set it."""
        self.trainer = trainer
        self.policy = config.policy
        # Greedy rollouts report log-probs at temperature 1 (the engine's convention); match them.
        self.temperature = config.rollout.rollout_temperature or 1.0
        self.pi_old = pi_old or pi_old_source(self.policy, decoupled=config.learner.use_decoupled_ppo)

    def train(self, samples: Sequence[Sample], staleness: Sequence[int], *, shard: bool = True) -> StepReport:
        """Every learner rank calls this; a data-parallel rank trains its share of the groups: cut here from the
        whole batch, or already cut at rank 0 (`shard=False`, and the rollout metrics are then the share's)."""
        batch_metrics = rollout_metrics(samples, staleness)
        parallel = self.trainer.data_parallel()
        batch = stages.to_step_batch(samples)
        if shard:
            batch = stages.own_shard(batch, parallel)
        if self.policy.needs_ref:
            stages.add_ref_log_probs(self.trainer, batch, temperature=self.temperature)
        if self.pi_old == "separate_forward":
            stages.add_old_log_probs(self.trainer, batch, temperature=self.temperature)
        if self.policy.loss_type != "sft":
            stages.add_advantages(self.policy, batch, parallel)
        loss = stages.build_loss(self.policy, batch, parallel,
                                 pi_old_from_forward=self.pi_old == "training_forward")
        result = self.trainer.train_step(batch.samples, loss, temperature=self.temperature,
                                         with_entropy=loss.needs_entropy)
        return StepReport(result=result, metrics={**result.metrics, **batch_metrics})


def rollout_metrics(samples: Sequence[Sample], staleness: Sequence[int]) -> dict[str, float]:
    """What the batch says about generation: reward, accuracy, lengths, truncation, staleness."""
    rewards = np.asarray([float(s.reward or 0.0) for s in samples])
    lengths = np.asarray([s.response_length for s in samples])
    metrics = {
        "rollout/reward_mean": float(rewards.mean()) if len(rewards) else float("nan"),
        "rollout/reward_std": float(rewards.std()) if len(rewards) else float("nan"),
        "rollout/accuracy": float((rewards >= 1.0).mean()) if len(rewards) else float("nan"),
        "rollout/response_length_mean": float(lengths.mean()) if len(lengths) else 0.0,
        "rollout/truncated_fraction": float(np.mean([s.status == "truncated" for s in samples])) if samples else 0.0,
        "rollout/samples": float(len(samples)),
        "rollout/tokens": float(lengths.sum()),
    }
    if staleness:
        values = np.asarray(staleness)
        metrics["staleness/max"] = float(values.max())
        metrics["staleness/mean"] = float(values.mean())
        for value, count in staleness_histogram(list(staleness)).items():
            metrics[f"staleness/hist_{value}"] = float(count)
    return metrics
