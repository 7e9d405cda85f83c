"""The learner step's loss as one object: built before the step with the whole step's denominators, then called
by the trainer on every micro-batch as ``loss(outputs, batch) -> (scalar, metrics)``.

Why an object. The trainer splits a step into micro-batches and data-parallel shards and SUMS their gradients,
so each micro-batch's loss must be divided by counts of the WHOLE step, after the off-policy correction's
rejections. Only the policy knows which count (trained tokens, trained sequences) and which rejections apply,
so it computes them once up front (:func:`step_denominators`) and the loss carries them: the trainer counts
nothing and calls nothing outside the loss it is handed.

No engine imports: the trainer's batch and model outputs are seen through the small structural protocols below
(``policies`` never imports ``engines``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from policies.aggregation import global_denominator
from policies.config import PolicyLossConfig
from policies.losses import (
    PgReducer,
    PolicyLossInputs,
    PolicyLossTerms,
    compute_policy_loss,
    compute_value_loss,
    effective_loss_mask,
)
from policies.packing import as_float_mask
from policies.pi_old import PiOldSource, pi_old_source
from policies.registry import LINEAR_IN_ADVANTAGE, POLICY_LOSSES

__all__ = ["ADDITIVE_METRICS", "PiOldSource", "PolicyLoss", "ValueLoss", "explained_variance", "pi_old_source",
           "step_denominators", "value_denominators", "zero_advantage_is_zero_gradient"]

# Loss terms already use the global denominators; every other metric is a local mean to be token-weighted.
ADDITIVE_METRICS = ("loss", "pg_loss", "kl_loss", "entropy_loss", "value_loss")


def zero_advantage_is_zero_gradient(config: PolicyLossConfig) -> bool:
    """Whether a sample whose advantages are all zero adds exactly nothing to the step's gradient.

    True for the built-in policy-gradient losses with no term that reads a sample beyond its advantage (no KL loss,
    no entropy bonus) and denominators fixed for the whole step before it starts (the loss's are): such a sample's
    forward and backward can be skipped, with the same update. GRPO gives every sample of a group whose rewards are
    all equal an advantage of exactly zero, which at the start and the end of a run is most of a batch.
    """
    return (LINEAR_IN_ADVANTAGE in POLICY_LOSSES.traits_of(config.loss_type) and config.entropy_coef == 0
            and not (config.use_kl_loss and config.kl_loss_coef != 0))



class LossBatch(Protocol):
    """The packed per-token fields a policy loss reads (``engines.training.base.PackedBatch`` has them)."""

    response_lengths: Tensor
    loss_mask: Tensor | None
    rollout_log_probs: Tensor | None
    old_log_probs: Tensor | None
    ref_log_probs: Tensor | None
    advantages: Tensor | None


class LossOutputs(Protocol):
    """The training forward's packed log-probs (with gradient) and optional entropy."""

    log_probs: Tensor
    entropy: Tensor | None


def step_denominators(config: PolicyLossConfig, *, loss_mask: Tensor, response_lengths: Tensor,
                      old_log_probs: Tensor | None, rollout_log_probs: Tensor | None) -> Tensor:
    """``float64 [2]``: this shard's (loss denominator after rejections, trained tokens), to be summed over ranks.

    The arguments are :func:`policies.losses.effective_loss_mask`'s, which gives the tokens kept. Sum over the
    data-parallel ranks before building :class:`PolicyLoss`; a single process uses them as they are.
    """
    keep = effective_loss_mask(
        config,
        loss_mask=loss_mask,
        response_lengths=response_lengths,
        old_log_probs=old_log_probs,
        rollout_log_probs=None if config.loss_type == "sft" else rollout_log_probs,
    )
    return _counts(config, keep, loss_mask, response_lengths)


def _counts(config: PolicyLossConfig, keep: Tensor, loss_mask: Tensor, response_lengths: Tensor) -> Tensor:
    """``float64 [2]``: the aggregation denominator over the kept tokens, and the trained tokens."""
    return torch.tensor(
        [global_denominator(config.loss_agg_mode, keep, response_lengths,
                            count_empty_samples=config.count_empty_samples), float(loss_mask.sum())],
        dtype=torch.float64,
    )


@dataclass(frozen=True)
class PolicyLoss:
    """The configured policy loss of one step, with that step's global denominators.

    ``denominator``: the aggregation denominator of the whole step (all ranks, after rejections);
    ``total_tokens``: trained tokens of the whole step, the weight of each micro-batch's diagnostic means;
    ``pi_old_from_forward``: take pi_old as ``sg(log pi_theta)`` of the training forward (see :func:`pi_old_source`);
    ``loss_fn``: the per-token policy loss as loaded (see :func:`policies.losses.compute_policy_loss`);
    ``pg_reducer``: the policy-gradient term's numerator in place of the mode's (the same function's argument).
    """

    config: PolicyLossConfig
    denominator: float
    total_tokens: float
    pi_old_from_forward: bool = False
    loss_fn: Callable[[PolicyLossConfig, PolicyLossInputs], PolicyLossTerms] | None = None
    pg_reducer: PgReducer | None = None

    @property
    def needs_entropy(self) -> bool:
        return self.config.entropy_coef != 0

    def __call__(self, outputs: LossOutputs, batch: LossBatch) -> tuple[Tensor, dict[str, float]]:
        if batch.loss_mask is None:
            raise ValueError("PolicyLoss: the batch has no loss_mask (the learner step always sets one)")
        old = outputs.log_probs.detach() if self.pi_old_from_forward else batch.old_log_probs
        loss, metrics = compute_policy_loss(
            self.config, log_probs=outputs.log_probs, old_log_probs=old,
            rollout_log_probs=None if self.config.loss_type == "sft" else batch.rollout_log_probs,
            advantages=batch.advantages, loss_mask=batch.loss_mask, response_lengths=batch.response_lengths,
            entropy=outputs.entropy, ref_log_probs=batch.ref_log_probs, denominator=self.denominator,
            loss_fn=self.loss_fn, pg_reducer=self.pg_reducer,
        )
        share = batch.loss_mask.sum() / max(1.0, self.total_tokens)  # a tensor: no host sync per micro-batch
        return loss, {k: (v if k in ADDITIVE_METRICS else v * share) for k, v in metrics.items()}


class ValueBatch(Protocol):
    """The packed per-token fields the critic's loss reads."""

    response_lengths: Tensor
    loss_mask: Tensor | None
    values: Tensor | None  # the critic's before the step: the clip's anchor
    returns: Tensor | None


def value_denominators(config: PolicyLossConfig, *, loss_mask: Tensor, response_lengths: Tensor) -> Tensor:
    """``float64 [2]``: this shard's (value-loss denominator, trained tokens), to be summed over ranks. The value
    loss aggregates as the policy loss does (``loss_agg_mode``), over the trained tokens, no rejections."""
    return _counts(config, as_float_mask(loss_mask, torch.float64), loss_mask, response_lengths)


@dataclass(frozen=True)
class ValueLoss:
    """The critic's clipped value loss of one step (slime's ``value_loss_function``: ``max((clip(V) - R)^2,
    (V - R)^2)``, clipped around the values before the step by ``value_clip``), with the step's denominators."""

    config: PolicyLossConfig
    denominator: float
    total_tokens: float

    def __call__(self, values: Tensor, batch: ValueBatch) -> tuple[Tensor, dict[str, float]]:
        if batch.loss_mask is None or batch.returns is None or batch.values is None:
            raise ValueError("ValueLoss: the batch needs loss_mask, values (before the step) and returns")
        loss, metrics = compute_value_loss(self.config, values=values, returns=batch.returns,
                                           loss_mask=batch.loss_mask, response_lengths=batch.response_lengths,
                                           old_values=batch.values, denominator=self.denominator)
        share = batch.loss_mask.sum() / max(1.0, self.total_tokens)  # a tensor: no host sync per micro-batch
        return loss, {k: (v if k in ADDITIVE_METRICS else v * share) for k, v in metrics.items()}


def explained_variance(values: Tensor, returns: Tensor, loss_mask: Tensor) -> float:
    """``1 - Var(returns - values) / Var(returns)`` over the trained tokens: 1 when the critic predicts the returns,
    0 when it does no better than their mean, negative when worse. NaN when the returns do not vary."""
    mask = as_float_mask(loss_mask, torch.float64)
    count = mask.sum()
    if count < 2:
        return float("nan")
    returns, values = returns.double(), values.double()

    def variance(x: Tensor) -> Tensor:
        mean = (x * mask).sum() / count
        return (((x - mean) * mask) ** 2).sum() / count

    spread = variance(returns)
    return float("nan") if spread == 0 else float(1 - variance(returns - values) / spread)
