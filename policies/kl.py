"""KL estimators between the current policy and a reference, per token (Schulman's k1/k2/k3).

With ``log_ratio = log pi - log pi_ref`` and samples drawn from pi:

- ``k1 = log_ratio``: unbiased for KL(pi || ref), high variance, can be negative per token.
- ``k2 = log_ratio**2 / 2``: biased, low variance, always >= 0.
- ``k3 = exp(-log_ratio) - 1 + log_ratio``: unbiased and always >= 0 (the GRPO paper's estimator).
- ``low_var_kl``: k3 clamped to [-10, 10], so one token with a collapsed reference probability cannot blow up
  the loss (the clamp is on the estimate itself, before any importance weight, so the weight's gradient survives;
  slime clamps after weighting: ``low_var_kl_clamp_after_weight``).

The importance-weighted form (``use_unbiased_kl``, DeepSeek-V3.2) multiplies by ``pi_theta / pi_old``: tokens were
sampled from pi_old, not pi_theta, so the plain estimate is biased once pi_theta moves; the weight is NOT
detached because its gradient is part of what makes the KL gradient unbiased.

Shapes: every input and output is a packed per-token tensor ``[T]``; the result is in the compute dtype
(float32, or float64 if the inputs are float64).
"""

from __future__ import annotations

from torch import Tensor

from policies.packing import as_compute_dtype
from policies.registry import register_kl, resolve_kl

__all__ = ["LOW_VAR_KL_CLAMP", "compute_kl", "k1", "k2", "k3", "low_var_kl"]

LOW_VAR_KL_CLAMP = 10.0


@register_kl("k1")
def k1(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    return as_compute_dtype(log_probs) - as_compute_dtype(ref_log_probs)


@register_kl("k2")
def k2(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    return (as_compute_dtype(log_probs) - as_compute_dtype(ref_log_probs)) ** 2 / 2


@register_kl("k3")
def k3(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    ref_minus_current = as_compute_dtype(ref_log_probs) - as_compute_dtype(log_probs)
    return ref_minus_current.exp() - 1 - ref_minus_current


@register_kl("low_var_kl")
def low_var_kl(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    return k3(log_probs, ref_log_probs).clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)


def compute_kl(kind: str, log_probs: Tensor, ref_log_probs: Tensor, *, importance_ratio: Tensor | None = None,
               clamp_after_weight: bool = False) -> Tensor:
    """Per-token KL estimate ``[T]`` by registered name or dotted path, optionally importance-weighted.

    ``clamp_after_weight`` (``low_var_kl`` only): clamp the weighted estimate instead of the estimate (slime's order).
    """
    if clamp_after_weight and kind == "low_var_kl" and importance_ratio is not None:
        weighted = k3(log_probs, ref_log_probs) * as_compute_dtype(importance_ratio)
        return weighted.clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)
    kl = resolve_kl(kind)(log_probs, ref_log_probs)
    if importance_ratio is not None:
        kl = kl * as_compute_dtype(importance_ratio)
    return kl
