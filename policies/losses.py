"""Policy losses (``--loss-type``) and the one learner entry point, :func:`compute_policy_loss`.

Per-token policy losses (registered; a user loss has the same signature
``fn(config, PolicyLossInputs) -> PolicyLossTerms``), all on packed ``[T]`` tensors:

- ``ppo``: clipped surrogate ``max(-r A, -clip(r, 1 - eps_clip, 1 + eps_clip_high) A)`` with ``r = pi_theta /
  pi_old``; clip-higher when ``eps_clip_high > eps_clip``; dual-clip caps the loss of negative advantages at
  ``-eps_clip_c * A``.
- ``gspo``: the same surrogate on the sequence ratio ``s_i = exp(mean_t log r_t)``, in its token form
  ``s_it = sg(s_i) * pi_theta(y_t) / sg(pi_theta(y_t))``: equal to ``s_i`` in value, gradient through each token's
  own log-prob, so it also accepts per-token advantages and reduces to sequence-level GSPO for sequence ones.
- ``cispo``: ``-sg(clip(r, 1 - eps_clip, 1 + eps_clip_high)) * A * log pi_theta``; gradient only through
  ``log pi_theta``, so clipped tokens still contribute (canonical CISPO: ``eps_clip >= 1``, no lower bound).
- ``sft``: ``-log pi_theta`` (advantages ignored).

The log-ratio ``log pi_theta - log pi_old`` is clamped to +-``log_ratio_clamp`` (20) before ``exp`` (ppo, gspo's
sequence ratio, cispo, the unbiased-KL weight) so a single diverged token gives a large but finite ratio instead of
``inf`` and ``inf * 0 = NaN``; slime does not clamp (``log_ratio_clamp=None``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from policies.aggregation import aggregate, global_denominator
from policies.config import PolicyLossConfig
from policies.corrections import CorrectionResult, mismatch_metrics, opsm_keep_mask
from policies.kl import compute_kl
from policies.packing import (
    as_compute_dtype,
    as_float_mask,
    check_finite,
    check_lengths,
    check_packed,
    masked_max,
    masked_mean,
    masked_min,
    masked_std,
    per_sample_count,
    per_sample_mean,
    to_tokens,
    zero_masked,
)
from policies.registry import LINEAR_IN_ADVANTAGE, register_policy_loss, resolve_correction, resolve_policy_loss

__all__ = [
    "PgReducer",
    "PolicyLossInputs",
    "PolicyLossTerms",
    "cispo_loss",
    "clipped_surrogate",
    "compute_policy_loss",
    "compute_value_loss",
    "effective_loss_mask",
    "gspo_loss",
    "ppo_loss",
    "sft_loss",
    "value_loss_terms",
]

MAX_LOG_RATIO = 20.0  # the default of PolicyLossConfig.log_ratio_clamp

# (per-token loss [T], kept-token mask [T], response lengths [B]) -> the term's numerator (a sum over samples)
PgReducer = Callable[[Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class PolicyLossInputs:
    """What a policy loss receives. ``log_probs`` carries the gradient; ``old_log_probs`` (pi_old) is detached.

    ``loss_mask`` is the effective 0/1 mask (after any rejection by the off-policy correction); all tensors are
    packed ``[T]`` in the compute dtype, zero at masked positions.
    """

    log_probs: Tensor
    old_log_probs: Tensor
    advantages: Tensor
    loss_mask: Tensor
    response_lengths: Tensor


@dataclass(frozen=True)
class PolicyLossTerms:
    """``per_token_loss: [T]`` (before weights and aggregation), ``clipped: [T]`` 0/1, ``ratio: [T]`` detached."""

    per_token_loss: Tensor
    clipped: Tensor
    ratio: Tensor
    extra_metrics: dict[str, Tensor] = field(default_factory=dict)


def clipped_surrogate(
    ratio: Tensor, advantages: Tensor, *, eps_clip: float, eps_clip_high: float, eps_clip_c: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    """PPO's pessimistic surrogate per token: ``(loss, clipped 0/1, dual_clipped 0/1)``."""
    unclipped = -ratio * advantages
    clipped_loss = -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * advantages
    loss = torch.maximum(unclipped, clipped_loss)
    clipped = (clipped_loss > unclipped).to(ratio.dtype)
    dual_clipped = torch.zeros_like(clipped)
    if eps_clip_c is not None:
        cap = -eps_clip_c * advantages
        negative = advantages < 0
        dual_clipped = (negative & (cap < loss)).to(ratio.dtype)
        loss = torch.where(negative, torch.minimum(loss, cap), loss)
    return loss, clipped, dual_clipped


def _exp_clamped(log_ratio: Tensor, clamp: float | None) -> Tensor:
    return (log_ratio if clamp is None else log_ratio.clamp(-clamp, clamp)).exp()


def _ratio(config: PolicyLossConfig, log_probs: Tensor, old_log_probs: Tensor) -> Tensor:
    return _exp_clamped(log_probs - old_log_probs, config.log_ratio_clamp)


def _clipped_terms(config: PolicyLossConfig, ratio: Tensor, inputs: PolicyLossInputs) -> PolicyLossTerms:
    """The clipped surrogate shared by PPO and GSPO; they differ only in how the ratio is formed."""
    assert config.eps_clip_high is not None
    loss, clipped, dual = clipped_surrogate(
        ratio,
        inputs.advantages,
        eps_clip=config.eps_clip,
        eps_clip_high=config.eps_clip_high,
        eps_clip_c=config.eps_clip_c,
    )
    extra = {"pg_dual_clipfrac": masked_mean(dual, inputs.loss_mask)} if config.eps_clip_c is not None else {}
    return PolicyLossTerms(per_token_loss=loss, clipped=clipped, ratio=ratio.detach(), extra_metrics=extra)


@register_policy_loss("ppo", traits=(LINEAR_IN_ADVANTAGE,))
def ppo_loss(config: PolicyLossConfig, inputs: PolicyLossInputs) -> PolicyLossTerms:
    ratio = _ratio(config, inputs.log_probs, inputs.old_log_probs)
    return _clipped_terms(config, ratio, inputs)


@register_policy_loss("gspo", traits=(LINEAR_IN_ADVANTAGE,))
def gspo_loss(config: PolicyLossConfig, inputs: PolicyLossInputs) -> PolicyLossTerms:
    seq_log_ratio = per_sample_mean(inputs.log_probs - inputs.old_log_probs, inputs.response_lengths, inputs.loss_mask)
    token_log_ratio = (
        to_tokens(seq_log_ratio.detach(), inputs.response_lengths) + inputs.log_probs - inputs.log_probs.detach()
    )
    ratio = _exp_clamped(token_log_ratio, config.log_ratio_clamp)
    return _clipped_terms(config, ratio, inputs)


@register_policy_loss("cispo", traits=(LINEAR_IN_ADVANTAGE,))
def cispo_loss(config: PolicyLossConfig, inputs: PolicyLossInputs) -> PolicyLossTerms:
    ratio = _ratio(config, inputs.log_probs, inputs.old_log_probs).detach()
    assert config.eps_clip_high is not None
    truncated = ratio.clamp(1 - config.eps_clip, 1 + config.eps_clip_high)
    loss = -truncated * inputs.advantages * inputs.log_probs
    return PolicyLossTerms(per_token_loss=loss, clipped=(truncated != ratio).to(ratio.dtype), ratio=ratio)


@register_policy_loss("sft")
def sft_loss(config: PolicyLossConfig, inputs: PolicyLossInputs) -> PolicyLossTerms:
    ones = torch.ones_like(inputs.loss_mask)
    return PolicyLossTerms(per_token_loss=-inputs.log_probs, clipped=torch.zeros_like(ones), ratio=ones)


def value_loss_terms(
    values: Tensor, returns: Tensor, old_values: Tensor | None, value_clip: float
) -> tuple[Tensor, Tensor]:
    """Clipped value loss per token ``max((clip(V) - R)^2, (V - R)^2)``, ``clip(V) = V_old + clamp(V - V_old, +-c)``.

    No 1/2 factor (slime's convention; scale with ``value_loss_coef``). Without ``old_values`` it is ``(V - R)^2``.
    Returns ``(loss [T], clipped 0/1 [T])``.
    """
    unclipped = (values - returns) ** 2
    if old_values is None:
        return unclipped, torch.zeros_like(unclipped)
    clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)
    loss = torch.maximum((clipped_values - returns) ** 2, unclipped)
    return loss, ((values - old_values).abs() > value_clip).to(values.dtype)


def compute_value_loss(
    config: PolicyLossConfig,
    *,
    values: Tensor,
    returns: Tensor,
    loss_mask: Tensor,
    response_lengths: Tensor,
    old_values: Tensor | None = None,
    denominator: float | Tensor | None = None,
    sample_denominators: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Critic loss for a separately trained value model (PPO); same aggregation rules as the policy loss."""
    lengths = check_lengths(response_lengths)
    dtype = as_compute_dtype(values).dtype
    mask = as_float_mask(_checked("loss_mask", loss_mask, lengths), dtype)
    reduce = _reducer(config, mask, mask, lengths, denominator, sample_denominators)
    loss, metrics = _value_term(config, values, returns, old_values, mask, lengths, dtype, reduce)
    return loss, _to_floats(metrics)


def compute_policy_loss(
    config: PolicyLossConfig,
    *,
    log_probs: Tensor,
    old_log_probs: Tensor | None,
    rollout_log_probs: Tensor | None,
    advantages: Tensor | None,
    loss_mask: Tensor,
    response_lengths: Tensor,
    entropy: Tensor | None = None,
    ref_log_probs: Tensor | None = None,
    values: Tensor | None = None,
    returns: Tensor | None = None,
    old_values: Tensor | None = None,
    denominator: float | Tensor | None = None,
    sample_denominators: Tensor | None = None,
    loss_fn: Callable[[PolicyLossConfig, PolicyLossInputs], PolicyLossTerms] | None = None,
    pg_reducer: PgReducer | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The learner's loss for one (micro-)batch: ratio, off-policy correction, clipping, KL, entropy, value, agg.

    Shapes: every per-token input is packed ``[T]`` (``T = response_lengths.sum()``), ``response_lengths [B]``.
    ``log_probs`` (pi_theta) carries the gradient; ``old_log_probs`` (pi_old, the learner's pre-update log-probs)
    and ``rollout_log_probs`` (mu, the engine's) are treated as constants. ``old_log_probs=None`` means pi_old := mu
    (no decoupling: the one-step-off setting); if both are None, pi_old := sg(pi_theta) (strictly on-policy, ratio
    1). ``denominator``/``sample_denominators``: see :mod:`policies.aggregation`; compute them on the whole batch
    with the correction's keep mask applied (:func:`effective_loss_mask`) so micro-batch losses sum exactly.
    ``loss_fn``: the per-token policy loss as the caller loaded it (a plugin converted from another convention);
    default: ``config.loss_type`` resolved in the registry.
    ``pg_reducer``: the numerator of the policy-gradient term in place of ``loss_agg_mode``'s (its sum over samples
    of the per-token loss after corrections, given the kept-token mask and the lengths); the term is that divided
    by the mode's denominator, as the mode's own numerator is. The other terms and every metric keep the mode.

    Returns ``(loss, metrics)``. Loss-term metrics (``pg_loss``, ``kl_loss``, ``entropy_loss``, ``value_loss``)
    use the same denominators as the loss, so they add up across micro-batches like the loss does; every other
    metric is a local mean over this micro-batch's trained tokens (weight it by ``num_tokens``).
    """
    lengths = check_lengths(response_lengths)
    check_packed("log_probs", log_probs, lengths)
    dtype = as_compute_dtype(log_probs).dtype
    original_mask = as_float_mask(_checked("loss_mask", loss_mask, lengths), dtype)
    log_probs = zero_masked(_checked_finite("log_probs", log_probs, lengths, original_mask, dtype), original_mask)

    behaviour = _optional_constant("rollout_log_probs", rollout_log_probs, lengths, original_mask, dtype)
    proximal = _optional_constant("old_log_probs", old_log_probs, lengths, original_mask, dtype)
    if proximal is None:
        proximal = behaviour if behaviour is not None else log_probs.detach()
    if behaviour is None and config.off_policy_correction != "none":
        raise ValueError(
            f"off_policy_correction={config.off_policy_correction!r} needs rollout_log_probs (the engine's log-probs)"
        )

    correction = _apply_correction(config, proximal, behaviour, original_mask, lengths)
    mask = original_mask * correction.keep_mask
    count_mask = original_mask if config.rejected_tokens_in_denominator else mask

    if advantages is None:
        if config.loss_type != "sft":
            raise ValueError(f"loss_type={config.loss_type!r} needs advantages")
        advantages = torch.zeros_like(log_probs)
    advantages = zero_masked(_checked_finite("advantages", advantages, lengths, original_mask, dtype), mask).detach()

    inputs = PolicyLossInputs(
        log_probs=log_probs, old_log_probs=proximal, advantages=advantages, loss_mask=mask, response_lengths=lengths
    )
    terms = (loss_fn or resolve_policy_loss(config.loss_type))(config, inputs)
    check_packed(f"per-token loss of loss_type {config.loss_type!r}", terms.per_token_loss, lengths)
    pg_per_token = terms.per_token_loss * correction.weights

    metrics: dict[str, Tensor] = {}
    if config.use_opsm:
        reference = behaviour if config.opsm_reference == "rollout" else proximal
        if reference is None:
            raise ValueError("use_opsm with opsm_reference='rollout' needs rollout_log_probs (the engine's log-probs)")
        keep, metrics["opsm_seqfrac"] = opsm_keep_mask(
            advantages=advantages,
            log_probs=log_probs,
            rollout_log_probs=reference,
            loss_mask=mask,
            response_lengths=lengths,
            delta=config.opsm_delta,
            per_token=config.opsm_token_advantage,
        )
        pg_per_token = pg_per_token * keep

    reduce = _reducer(config, mask, count_mask, lengths, denominator, sample_denominators)

    if pg_reducer is None:
        pg_loss = reduce(pg_per_token)
    else:
        divisor = denominator if denominator is not None else global_denominator(
            config.loss_agg_mode, count_mask, lengths, count_empty_samples=config.count_empty_samples)
        pg_loss = pg_reducer(pg_per_token, mask, lengths) / max(float(divisor), 1.0)
    loss = pg_loss
    metrics["pg_loss"] = pg_loss.detach()

    if entropy is not None:
        entropy = zero_masked(_checked_finite("entropy", entropy, lengths, original_mask, dtype), mask)
        entropy_loss = reduce(entropy)
        loss = loss - config.entropy_coef * entropy_loss
        metrics["entropy_loss"] = entropy_loss.detach()
    elif config.entropy_coef != 0:
        raise ValueError(f"entropy_coef={config.entropy_coef} needs entropy (per-token entropy of pi_theta)")

    if config.use_kl_loss:
        if ref_log_probs is None:
            raise ValueError("use_kl_loss needs ref_log_probs (the reference model's log-probs)")
        ref = zero_masked(_checked_finite("ref_log_probs", ref_log_probs, lengths, original_mask, dtype), mask)
        weight = _ratio(config, log_probs, proximal) if config.use_unbiased_kl else None
        kl = compute_kl(
            config.kl_loss_type,
            log_probs,
            ref.detach(),
            importance_ratio=weight,
            clamp_after_weight=config.low_var_kl_clamp_after_weight,
        )
        kl_loss = reduce(kl)
        loss = loss + config.kl_loss_coef * kl_loss
        metrics["kl_loss"] = kl_loss.detach()

    if values is not None:
        if returns is None:
            raise ValueError("values given without returns: the value loss needs both")
        value_loss, value_metrics = _value_term(config, values, returns, old_values, mask, lengths, dtype, reduce)
        loss = loss + config.value_loss_coef * value_loss
        metrics.update(value_metrics)

    metrics.update(_diagnostics(terms, advantages, log_probs, proximal, behaviour, original_mask, mask, lengths))
    metrics.update(correction.metrics)
    metrics.update(terms.extra_metrics)
    metrics["loss"] = loss.detach()
    return loss, _to_floats(metrics)


def effective_loss_mask(
    config: PolicyLossConfig,
    *,
    loss_mask: Tensor,
    response_lengths: Tensor,
    old_log_probs: Tensor | None,
    rollout_log_probs: Tensor | None,
) -> Tensor:
    """The loss mask after the correction's rejections (MIS), for computing global denominators up front.

    The correction depends only on pi_old and mu, both known before the step, so the learner can call this on
    the whole batch, feed the result to :func:`policies.aggregation.global_denominator`, and get micro-batch
    losses that sum exactly to the full-batch loss even when tokens are rejected.
    """
    lengths = check_lengths(response_lengths)
    mask = as_float_mask(_checked("loss_mask", loss_mask, lengths), torch.float64)
    behaviour = _optional_constant("rollout_log_probs", rollout_log_probs, lengths, mask, torch.float64)
    proximal = _optional_constant("old_log_probs", old_log_probs, lengths, mask, torch.float64)
    if behaviour is None or config.rejected_tokens_in_denominator:
        return mask
    proximal = behaviour if proximal is None else proximal
    return mask * _apply_correction(config, proximal, behaviour, mask, lengths).keep_mask


# --------------------------------------------------------------------------------------------------------------


def _reducer(
    config: PolicyLossConfig,
    mask: Tensor,
    count_mask: Tensor,
    lengths: Tensor,
    denominator: float | Tensor | None,
    sample_denominators: Tensor | None,
) -> Callable[[Tensor], Tensor]:
    """The one aggregation every loss term uses: numerators over ``mask``, local counts over ``count_mask``."""

    def reduce(per_token: Tensor) -> Tensor:
        return aggregate(
            per_token,
            mask,
            lengths,
            config.loss_agg_mode,
            denominator=denominator,
            sample_denominators=sample_denominators,
            count_empty_samples=config.count_empty_samples,
            count_mask=count_mask,
        )

    return reduce


def _apply_correction(
    config: PolicyLossConfig, proximal: Tensor, behaviour: Tensor | None, mask: Tensor, lengths: Tensor
) -> CorrectionResult:
    if behaviour is None:
        ones = torch.ones_like(mask)
        return CorrectionResult(weights=ones, keep_mask=ones)
    result = resolve_correction(config.off_policy_correction)(
        config, old_log_probs=proximal, rollout_log_probs=behaviour, loss_mask=mask, response_lengths=lengths
    )
    name = f"off-policy correction {config.off_policy_correction!r}"
    check_packed(f"{name} weights", result.weights, lengths)
    check_packed(f"{name} keep_mask", result.keep_mask, lengths)
    weights = zero_masked(result.weights.detach().to(mask.dtype), mask)
    check_finite(f"{name} weights", weights, mask)
    metrics = {**mismatch_metrics(proximal, behaviour, mask), **result.metrics}
    return CorrectionResult(weights=weights, keep_mask=result.keep_mask.detach().to(mask.dtype), metrics=metrics)


def _value_term(
    config: PolicyLossConfig,
    values: Tensor,
    returns: Tensor,
    old_values: Tensor | None,
    mask: Tensor,
    lengths: Tensor,
    dtype: torch.dtype,
    reduce: Callable[[Tensor], Tensor],
) -> tuple[Tensor, dict[str, Tensor]]:
    values = zero_masked(_checked_finite("values", values, lengths, mask, dtype), mask)
    returns = zero_masked(_checked_finite("returns", returns, lengths, mask, dtype), mask).detach()
    if old_values is not None:
        old_values = zero_masked(_checked_finite("old_values", old_values, lengths, mask, dtype), mask).detach()
    per_token, clipped = value_loss_terms(values, returns, old_values, config.value_clip)
    value_loss = reduce(per_token)
    return value_loss, {"value_loss": value_loss.detach(), "value_clipfrac": masked_mean(clipped, mask)}


def _diagnostics(
    terms: PolicyLossTerms,
    advantages: Tensor,
    log_probs: Tensor,
    proximal: Tensor,
    behaviour: Tensor | None,
    original_mask: Tensor,
    mask: Tensor,
    lengths: Tensor,
) -> dict[str, Tensor]:
    log_ratio = (proximal - log_probs.detach()) * mask
    ratio = terms.ratio.detach()
    return {
        "pg_clipfrac": masked_mean(terms.clipped.detach(), mask),
        "ppo_kl": masked_mean(log_ratio, mask),
        "approx_kl": masked_mean(log_ratio.exp() - 1 - log_ratio, mask),
        "ratio_mean": masked_mean(ratio, mask),
        "ratio_max": masked_max(ratio, mask),
        "ratio_min": masked_min(ratio, mask),
        "advantage_mean": masked_mean(advantages, mask),
        "advantage_std": masked_std(advantages, mask),
        "advantage_max": masked_max(advantages, mask),
        "advantage_min": masked_min(advantages, mask),
        "num_tokens": mask.sum(),
        "num_sequences": (per_sample_count(mask, lengths) > 0).sum().to(mask.dtype),
        "num_rejected_tokens": (original_mask - mask).sum(),
    }


def _checked(name: str, tensor: Tensor, lengths: Tensor) -> Tensor:
    check_packed(name, tensor, lengths)
    return tensor


def _checked_finite(name: str, tensor: Tensor, lengths: Tensor, mask: Tensor, dtype: torch.dtype) -> Tensor:
    check_packed(name, tensor, lengths)
    check_finite(name, tensor, mask)
    return as_compute_dtype(tensor).to(dtype)


def _optional_constant(
    name: str, tensor: Tensor | None, lengths: Tensor, mask: Tensor, dtype: torch.dtype
) -> Tensor | None:
    if tensor is None:
        return None
    return zero_masked(_checked_finite(name, tensor, lengths, mask, dtype), mask).detach()


def _to_floats(metrics: dict[str, Tensor]) -> dict[str, float]:
    """One device sync for all metrics instead of one ``.item()`` each."""
    if not metrics:
        return {}
    keys = list(metrics)
    values = torch.stack([metrics[k].detach().to(torch.float64).reshape(()) for k in keys]).tolist()
    return dict(zip(keys, values, strict=True))
