"""One learner step on a batch of samples: advantages, the loss from `policies/`, one optimizer step, metrics.

Kept apart from the learner actor so it runs (and is tested) without any socket. Denominators are computed
once on the whole batch, with the off-policy correction's rejections applied, so the trainer's micro-batches
add up to exactly the full-batch loss; per-micro-batch diagnostic means are weighted by their token share
for the same reason (the trainer sums metrics over micro-batches).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from actors.config import RunConfig
from bus.schema import Sample
from engines.training.base import LossNormalizer, ModelOutputs, PackedBatch, StepResult, Trainer, TrainSample
from policies.advantages import compute_advantages
from policies.aggregation import global_denominator
from policies.losses import compute_policy_loss, effective_loss_mask
from policies.staleness import staleness_histogram

# Loss terms already use the global denominators; every other metric is a local mean to be token-weighted.
ADDITIVE_METRICS = ("loss", "pg_loss", "kl_loss", "entropy_loss", "value_loss")


@dataclass
class StepReport:
    result: StepResult
    metrics: dict[str, float]


def to_train_sample(sample: Sample) -> TrainSample:
    """Copies out of the decoded frame: bus arrays are read-only views that must not outlive the message."""
    length = int(sample.response_length)
    mask = sample.loss_mask if sample.loss_mask is not None else np.ones(length)
    fields = {"loss_mask": torch.tensor(np.asarray(mask), dtype=torch.float32)}
    if sample.rollout_log_probs is not None:
        fields["rollout_log_probs"] = torch.tensor(np.asarray(sample.rollout_log_probs), dtype=torch.float32)
    return TrainSample(tokens=torch.tensor(np.asarray(sample.tokens), dtype=torch.long), response_length=length,
                       token_fields=fields, sample_fields={"reward": float(sample.reward or 0.0)})


def _packed(samples: Sequence[TrainSample], name: str) -> torch.Tensor:
    return torch.cat([s.token_fields[name] for s in samples]) if samples else torch.zeros(0)


def _split(packed: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    return list(torch.split(packed, lengths))


class TrainingStep:
    def __init__(self, trainer: Trainer, config: RunConfig) -> None:
        self.trainer = trainer
        self.config = config
        self.policy = config.policy
        self.is_sft = self.policy.loss_type == "sft"
        # pi_old must come from the learner whenever a correction is on: with pi_old := mu (the engine's
        # log-probs) the behaviour weight pi_old / mu is identically 1 and TIS/MIS/IcePop would do nothing.
        self.recompute_old = not self.is_sft and (config.use_decoupled_ppo
                                                  or self.policy.off_policy_correction != "none")

    def train(self, samples: Sequence[Sample], staleness: Sequence[int]) -> StepReport:
        """Every learner rank calls this with the whole batch; a data-parallel rank trains its share of groups."""
        batch_metrics = rollout_metrics(samples, staleness)
        parallel = self.trainer.data_parallel()
        if parallel.size > 1:
            samples = [samples[i] for i in data_parallel_shard([s.group_id for s in samples],
                                                               [int(s.response_length) for s in samples],
                                                               rank=parallel.rank, size=parallel.size)]
        train_samples = [to_train_sample(s) for s in samples]
        lengths = [s.response_length for s in train_samples]
        response_lengths = torch.tensor(lengths, dtype=torch.long)
        loss_mask = _packed(train_samples, "loss_mask")
        # Greedy rollouts report log-probs at temperature 1 (the engine's convention); match them.
        temperature = self.config.rollout_temperature or 1.0
        needs_ref = self.policy.use_kl_loss or self.policy.kl_coef > 0

        if needs_ref:
            ref = self.trainer.compute_log_probs(train_samples, temperature=temperature, model="ref").log_probs
            for sample, values in zip(train_samples, _split(ref, lengths), strict=True):
                sample.token_fields["ref_log_probs"] = values
        if self.recompute_old:
            old = self.trainer.compute_log_probs(train_samples, temperature=temperature).log_probs
            for sample, values in zip(train_samples, _split(old, lengths), strict=True):
                sample.token_fields["old_log_probs"] = values

        if not self.is_sft:
            group_ids = _group_indices([s.group_id for s in samples])
            rewards = torch.tensor([float(s.reward or 0.0) for s in samples], dtype=torch.float32)
            behaviour = _packed(train_samples, "rollout_log_probs")
            advantages, _returns = compute_advantages(
                self.policy, rewards=rewards, group_ids=group_ids, response_lengths=response_lengths,
                loss_mask=loss_mask, log_probs=_packed(train_samples, "old_log_probs")
                if self.recompute_old else behaviour,
                ref_log_probs=_packed(train_samples, "ref_log_probs") if needs_ref else None,
                process_group=parallel.group if parallel.size > 1 else None,
            )
            for sample, values in zip(train_samples, _split(advantages.float(), lengths), strict=True):
                sample.token_fields["advantages"] = values

        keep_mask = effective_loss_mask(
            self.policy, loss_mask=loss_mask, response_lengths=response_lengths,
            old_log_probs=_packed(train_samples, "old_log_probs") if self.recompute_old else None,
            rollout_log_probs=None if self.is_sft else _packed(train_samples, "rollout_log_probs"),
        )
        counts = torch.tensor([global_denominator(self.policy.loss_agg_mode, keep_mask, response_lengths),
                               float(loss_mask.sum())], dtype=torch.float64)
        if parallel.size > 1:  # whole-step denominators: every rank's shard counts
            torch.distributed.all_reduce(counts, group=parallel.group)
        denominator, total_tokens = float(counts[0]), max(1.0, float(counts[1]))

        def loss_fn(outputs: ModelOutputs, batch: PackedBatch, _normalizer: LossNormalizer):
            fields = batch.token_fields
            loss, metrics = compute_policy_loss(
                self.policy, log_probs=outputs.log_probs, old_log_probs=fields.get("old_log_probs"),
                rollout_log_probs=None if self.is_sft else fields.get("rollout_log_probs"),
                advantages=fields.get("advantages"), loss_mask=fields["loss_mask"],
                response_lengths=batch.response_lengths, entropy=outputs.entropy,
                ref_log_probs=fields.get("ref_log_probs"), denominator=denominator,
            )
            share = float(fields["loss_mask"].sum()) / total_tokens
            return loss, {k: (v if k in ADDITIVE_METRICS else v * share) for k, v in metrics.items()}

        result = self.trainer.train_step(train_samples, loss_fn, temperature=temperature,
                                         with_entropy=self.policy.entropy_coef != 0)
        return StepReport(result=result, metrics={**result.metrics, **batch_metrics})


def data_parallel_shard(group_ids: Sequence[str], lengths: Sequence[int], *, rank: int, size: int) -> list[int]:
    """Indices of the samples rank `rank` of `size` trains on: whole groups, dealt to balance response tokens.

    Whole groups keep group-relative advantages computable on each rank alone. Groups go largest first to the
    rank with the fewest tokens so far (ties to the lower rank), which every rank computes identically.
    """
    members: dict[str, list[int]] = {}
    for index, group_id in enumerate(group_ids):
        members.setdefault(group_id, []).append(index)
    if len(members) < size:
        raise ValueError(f"a batch of {len(members)} groups cannot feed {size} data-parallel ranks; "
                         f"raise --rollout-batch-size to at least {size}")
    load = [0] * size
    held = [0] * size
    mine: list[int] = []
    order = sorted(members.values(), key=lambda indices: (-sum(lengths[i] for i in indices), indices[0]))
    for indices in order:
        target = min(range(size), key=lambda r: (load[r], held[r], r))
        load[target] += sum(lengths[i] for i in indices)
        held[target] += 1
        if target == rank:
            mine.extend(indices)
    return sorted(mine)


def _group_indices(group_ids: Sequence[str]) -> torch.Tensor:
    index: dict[str, int] = {}
    return torch.tensor([index.setdefault(g, len(index)) for g in group_ids], dtype=torch.long)


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
