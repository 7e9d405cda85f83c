"""Off-policy corrections for the behaviour/learner mismatch (``--off-policy-correction none|tis|mis|icepop``).

Three policies are in play (decoupled PPO): the engine's behaviour policy mu that sampled the tokens (its
log-probs travel with the sample), the learner's proximal policy pi_old (log-probs recomputed before the update),
and the current pi_theta. The PPO ratio is ``pi_theta / pi_old``; a correction turns the behaviour ratio
``w = pi_old / mu`` into a DETACHED per-token weight on the policy loss and, for rejection methods, a keep mask:

- ``none``: weight 1 (plain decoupled PPO; with ``old_log_probs=None`` pi_old is mu and w is 1 anyway).
- ``tis``: truncated IS, ``clamp(w, tis_clip_low, tis_clip)`` at ``tis_level`` token / sequence (product of
  token ratios) / geometric (their geometric mean).
- ``mis``: masked IS, reject instead of clamp: tokens (``mis_level=token``) or whole sequences (``sequence``,
  ``geometric``) whose ratio leaves ``[mis_lower_bound, mis_upper_bound]`` are REMOVED from the loss, including
  its denominators; kept ones are weighted by their ratio. ``mis_veto_threshold`` rejects any sequence holding a
  token with ``w`` below it (a token the learner thinks nearly impossible).
- ``icepop``: keep ``w`` inside ``[tis_clip_low, tis_clip]``, weight 0 outside (token level, slime's flags). Unlike
  mis, zeroed tokens stay in the denominator: the gradient is dropped, the normalisation is not.

Every correction reports the fraction of trained tokens it clipped or masked, the mean applied weight, mean
``|w - 1|`` of the raw token ratio, and the mean train-rollout log-prob absolute difference.

A user correction (dotted path) has the same signature as the built-ins:
``fn(config, *, old_log_probs, rollout_log_probs, loss_mask, response_lengths) -> CorrectionResult``, with
packed ``[T]`` detached tensors and a 0/1 float ``loss_mask``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from policies.config import PolicyLossConfig
from policies.packing import masked_mean, per_sample_count, per_sample_mean, per_sample_sum, to_tokens
from policies.registry import register_correction

__all__ = [
    "CorrectionResult",
    "icepop",
    "level_log_weights",
    "mis",
    "mismatch_metrics",
    "no_correction",
    "opsm_keep_mask",
    "tis",
]

# exp() of a log-ratio beyond this is reported as saturated rather than inf; weights are bounded before exp.
_MAX_LOG_RATIO = 20.0


@dataclass(frozen=True)
class CorrectionResult:
    """``weights: [T]`` multiply the per-token policy loss (detached); ``keep_mask: [T]`` 0 removes a token from
    the whole loss and its denominators. ``metrics`` are scalar tensors, logged as floats by the caller."""

    weights: Tensor
    keep_mask: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class _Inputs:
    """What the built-ins read: ``log_w = log pi_old - log mu`` per token, the 0/1 mask and the lengths."""

    log_w: Tensor
    loss_mask: Tensor
    response_lengths: Tensor


_BuiltinCorrection = Callable[[PolicyLossConfig, _Inputs], CorrectionResult]


def _builtin(name: str) -> Callable[[_BuiltinCorrection], Callable[..., CorrectionResult]]:
    """Give a built-in the plugin signature (the one place that spells it out) and register it under ``name``."""

    def register(fn: _BuiltinCorrection) -> Callable[..., CorrectionResult]:
        def correction(
            config: PolicyLossConfig,
            *,
            old_log_probs: Tensor,
            rollout_log_probs: Tensor,
            loss_mask: Tensor,
            response_lengths: Tensor,
        ) -> CorrectionResult:
            return fn(config, _Inputs(old_log_probs - rollout_log_probs, loss_mask, response_lengths))

        correction.__name__ = correction.__qualname__ = fn.__name__
        correction.__doc__ = fn.__doc__
        return register_correction(name)(correction)

    return register


def _log_band(low: float, high: float) -> tuple[float, float]:
    """``(log low, log high)`` of a ratio band; a lower bound of 0 is no bound."""
    return (math.log(low) if low > 0 else -math.inf), math.log(high)


def level_log_weights(log_w: Tensor, loss_mask: Tensor, response_lengths: Tensor, level: str) -> Tensor:
    """Per-token log-weights ``[T]`` at a level: the token's own, its sequence's sum, or its sequence's mean."""
    if level == "token":
        return log_w
    if level == "sequence":
        return to_tokens(per_sample_sum(log_w, response_lengths, loss_mask), response_lengths)
    if level == "geometric":
        return to_tokens(per_sample_mean(log_w, response_lengths, loss_mask), response_lengths)
    raise ValueError(f"importance-sampling level: unknown {level!r}; expected token, sequence or geometric")


def mismatch_metrics(old_log_probs: Tensor, rollout_log_probs: Tensor, loss_mask: Tensor) -> dict[str, Tensor]:
    """Train-vs-rollout diagnostics reported whatever the correction (they are how users spot engine drift)."""
    log_w = old_log_probs - rollout_log_probs
    raw_w = log_w.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()
    return {
        "is_weight_abs_dev": masked_mean((raw_w - 1).abs(), loss_mask),
        "train_rollout_logprob_abs_diff": masked_mean(log_w.abs(), loss_mask),
    }


@_builtin("none")
def no_correction(config: PolicyLossConfig, inputs: _Inputs) -> CorrectionResult:
    ones = torch.ones_like(inputs.loss_mask)
    return CorrectionResult(weights=ones, keep_mask=ones)


@_builtin("tis")
def tis(config: PolicyLossConfig, inputs: _Inputs) -> CorrectionResult:
    """Truncated importance sampling: ``clamp(w, tis_clip_low, tis_clip)`` at ``tis_level``."""
    loss_mask = inputs.loss_mask
    log_w = level_log_weights(inputs.log_w, loss_mask, inputs.response_lengths, config.tis_level)
    log_low, log_high = _log_band(config.tis_clip_low, config.tis_clip)
    weights = log_w.clamp(max=log_high).exp().clamp_min(config.tis_clip_low)
    clipped = ((log_w > log_high) | (log_w < log_low)).to(loss_mask.dtype)
    return CorrectionResult(
        weights=weights,
        keep_mask=torch.ones_like(loss_mask),
        metrics={"is_clipfrac": masked_mean(clipped, loss_mask), "is_weight_mean": masked_mean(weights, loss_mask)},
    )


@_builtin("mis")
def mis(config: PolicyLossConfig, inputs: _Inputs) -> CorrectionResult:
    """Masked importance sampling: reject tokens or sequences whose ratio leaves the band; optional veto."""
    token_log_w, loss_mask, response_lengths = inputs.log_w, inputs.loss_mask, inputs.response_lengths
    log_w = level_log_weights(token_log_w, loss_mask, response_lengths, config.mis_level)
    assert config.mis_lower_bound is not None  # filled in by the config validator
    log_low, log_high = _log_band(config.mis_lower_bound, config.mis_upper_bound)
    rejected = (log_w < log_low) | (log_w > log_high)
    metrics: dict[str, Tensor] = {}
    if config.mis_veto_threshold is not None:
        catastrophic = ((token_log_w < math.log(config.mis_veto_threshold)) & (loss_mask > 0)).to(loss_mask.dtype)
        vetoed_seq = per_sample_sum(catastrophic, response_lengths) > 0
        rejected = rejected | to_tokens(vetoed_seq, response_lengths)
        trained_seq = per_sample_count(loss_mask, response_lengths) > 0
        metrics["is_veto_seqfrac"] = vetoed_seq.to(loss_mask.dtype).sum() / trained_seq.sum().clamp_min(1)
    keep = (~rejected).to(loss_mask.dtype)
    weights = torch.where(rejected, torch.zeros_like(log_w), log_w.clamp(max=log_high).exp())
    metrics["is_maskfrac"] = masked_mean(1 - keep, loss_mask)
    metrics["is_weight_mean"] = masked_mean(weights, loss_mask * keep)
    return CorrectionResult(weights=weights, keep_mask=keep, metrics=metrics)


@_builtin("icepop")
def icepop(config: PolicyLossConfig, inputs: _Inputs) -> CorrectionResult:
    """IcePop: token weight ``w`` inside ``[tis_clip_low, tis_clip]``, 0 outside; denominators unchanged."""
    log_w, loss_mask = inputs.log_w, inputs.loss_mask
    log_low, log_high = _log_band(config.tis_clip_low, config.tis_clip)
    outside = (log_w < log_low) | (log_w > log_high)
    weights = torch.where(outside, torch.zeros_like(log_w), log_w.clamp(max=log_high).exp())
    return CorrectionResult(
        weights=weights,
        keep_mask=torch.ones_like(loss_mask),
        metrics={
            "is_maskfrac": masked_mean(outside.to(loss_mask.dtype), loss_mask),
            "is_weight_mean": masked_mean(weights, loss_mask),
        },
    )


def opsm_keep_mask(
    *,
    advantages: Tensor,
    log_probs: Tensor,
    rollout_log_probs: Tensor,
    loss_mask: Tensor,
    response_lengths: Tensor,
    delta: float,
    per_token: bool = True,
) -> tuple[Tensor, Tensor]:
    """Off-policy sequence masking (DeepSeek-V3.2): ``(keep [T], fraction of trained sequences with a masked token)``.

    A sequence is off-policy when its mean ``log mu - log pi_theta`` over trained tokens (the sampled sequence's KL
    from the behaviour policy, on detached current log-probs) exceeds ``delta``. In it, a token is masked when its
    advantage is negative (``per_token``, the paper's ``M_{i,t}`` and slime's rule), or every token when the
    sequence's mean advantage is negative (``per_token=False``); the two agree for sequence-level advantages
    (GRPO). Pushing down already-unlikely off-policy samples is where negative updates do the most damage. Masked
    tokens keep their place in the denominator (slime's behaviour).
    """
    seq_kl = per_sample_mean(rollout_log_probs - log_probs.detach(), response_lengths, loss_mask)
    off_policy = to_tokens(seq_kl > delta, response_lengths)
    if per_token:
        negative = advantages < 0
    else:
        negative = to_tokens(per_sample_mean(advantages, response_lengths, loss_mask) < 0, response_lengths)
    masked = (negative & off_policy).to(loss_mask.dtype)
    hit = per_sample_sum(masked, response_lengths, loss_mask) > 0
    trained = per_sample_count(loss_mask, response_lengths) > 0
    fraction = hit.to(loss_mask.dtype).sum() / trained.sum().clamp_min(1)
    return 1 - masked, fraction
