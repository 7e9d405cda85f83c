"""Reduce a packed per-token loss to a scalar, so that micro-batches and data-parallel ranks add up exactly.

Modes (``loss_agg_mode``), with ``m`` the loss mask and ``x`` the per-token loss:

- ``token-mean``: ``sum_i sum_t x m / N_tokens`` (slime's ``--calculate-per-token-loss``; DAPO).
- ``seq-mean-token-mean``: ``sum_i (sum_t x m / n_i) / N_seqs`` (slime's default; GRPO paper).
- ``seq-mean-token-sum``: ``sum_i sum_t x m / N_seqs`` (Dr.GRPO: no per-length normalisation).

The learner splits a batch into micro-batches and across data-parallel ranks and SUMS gradients, so every
denominator that spans samples (``N_tokens``, ``N_seqs``) must be the global one: pass ``denominator`` from
:func:`global_denominator` computed on the whole batch, and the micro-batch losses sum to the full-batch loss.
Without it, local counts are used (right for a single, unsplit batch).

A *sequence* is a sample with at least one trained token: an all-masked sample contributes nothing and does not
dilute ``N_seqs`` or ``N_tokens``. ``count_empty_samples=True`` gives slime's denominators instead: every sample
counts as a sequence, and an all-masked one as one token.

Samples that share a rollout (a multi-turn episode split into one sample per turn) can be made to count as ONE
sequence: pass ``sample_denominators`` from :func:`rollout_token_denominators`, so each
sample is divided by its rollout's total trained tokens (the per-sample terms then sum to the rollout's token
mean), and count rollouts in ``denominator``. Both must come from the whole batch, because a rollout's samples
may land in different micro-batches.
"""

from __future__ import annotations

from typing import get_args

import torch
from torch import Tensor

from policies.config import AggregationMode
from policies.packing import as_float_mask, group_index, per_sample_count, per_sample_sum

__all__ = ["aggregate", "global_denominator", "rollout_token_denominators"]

_MODES = get_args(AggregationMode)


def aggregate(
    per_token: Tensor,
    loss_mask: Tensor,
    response_lengths: Tensor,
    mode: str,
    *,
    denominator: float | Tensor | None = None,
    sample_denominators: Tensor | None = None,
    count_empty_samples: bool = False,
    count_mask: Tensor | None = None,
) -> Tensor:
    """Scalar loss from ``per_token: [T]`` under ``mode``; ``loss_mask: [T]`` (0/1), ``response_lengths: [B]``.

    ``denominator``: global token count (token-mean) or sequence count (seq-mean-*); default: local count (see
    ``count_empty_samples`` in the module docstring). ``sample_denominators: [B]``: per-sample token denominators
    for seq-mean-token-mean (per-rollout sharing). ``count_mask``: the mask the local counts are taken from when it
    is not ``loss_mask`` (rejected tokens that stay in the denominators).
    """
    mask = as_float_mask(loss_mask, per_token.dtype)
    counting = mask if count_mask is None else as_float_mask(count_mask, per_token.dtype)
    if mode == "token-mean":
        total = (per_token * mask).sum()
        if denominator is None:
            denominator = _token_count(counting, response_lengths, count_empty_samples)
        return total / denominator
    if mode not in _MODES:
        raise ValueError(f"loss_agg_mode: unknown mode {mode!r}; expected one of {', '.join(_MODES)}")
    sums = per_sample_sum(per_token, response_lengths, mask)
    counts = per_sample_count(counting, response_lengths)
    if mode == "seq-mean-token-mean":
        if sample_denominators is None:
            sums = sums / counts.clamp_min(1)
        else:
            if sample_denominators.shape != sums.shape:
                raise ValueError(
                    f"sample_denominators: expected shape {tuple(sums.shape)} (one per sample), "
                    f"got {tuple(sample_denominators.shape)}"
                )
            sums = sums / sample_denominators.to(sums.dtype).clamp_min(1)
    if denominator is None:
        trained = torch.ones_like(counts, dtype=torch.bool) if count_empty_samples else counts > 0
        denominator = trained.sum().clamp_min(1).to(sums.dtype)
    return sums.sum() / denominator


def _token_count(mask: Tensor, response_lengths: Tensor, count_empty_samples: bool) -> Tensor:
    """Trained tokens, plus one per all-masked sample when ``count_empty_samples`` (slime's ``clamp_min(n_i, 1)``)."""
    if count_empty_samples:
        return per_sample_count(mask, response_lengths).clamp_min(1).sum()
    return mask.sum().clamp_min(1)


def global_denominator(
    mode: str,
    loss_mask: Tensor,
    response_lengths: Tensor,
    *,
    rollout_ids: Tensor | None = None,
    count_empty_samples: bool = False,
) -> float:
    """The denominator of ``mode`` for the WHOLE batch: trained tokens (token-mean) or trained sequences.

    With ``rollout_ids: [B]``, sequences are counted per rollout (a rollout counts if any of its samples has a
    trained token). Compute this on the global batch (after any rejection mask) before splitting it.
    ``count_empty_samples``: slime's counting (every sample is a sequence; an all-masked one is one token).
    """
    mask = as_float_mask(loss_mask, torch.float64)
    if mode == "token-mean":
        if count_empty_samples:
            return float(_token_count(mask, response_lengths, count_empty_samples))
        return float(mask.sum())
    if mode not in _MODES:
        raise ValueError(f"loss_agg_mode: unknown mode {mode!r}; expected one of {', '.join(_MODES)}")
    trained = per_sample_count(mask, response_lengths) > 0
    if count_empty_samples:
        trained = torch.ones_like(trained)
    if rollout_ids is None:
        return float(trained.sum())
    inverse, n_rollouts = group_index(rollout_ids)
    rollout_trained = torch.zeros(n_rollouts, dtype=torch.float64, device=mask.device)
    rollout_trained = rollout_trained.index_add(0, inverse.to(mask.device), trained.double())
    return float((rollout_trained > 0).sum())


def rollout_token_denominators(loss_mask: Tensor, response_lengths: Tensor, rollout_ids: Tensor) -> Tensor:
    """``Tensor[B]``: for each sample, the trained-token total of its whole rollout (shared by sibling samples)."""
    mask = as_float_mask(loss_mask, torch.float64)
    counts = per_sample_count(mask, response_lengths)
    inverse, n_rollouts = group_index(rollout_ids.to(counts.device))
    totals = torch.zeros(n_rollouts, dtype=counts.dtype, device=counts.device).index_add(0, inverse, counts)
    return totals[inverse]
