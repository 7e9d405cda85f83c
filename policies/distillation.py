"""On-policy distillation (OPD): a teacher's log-probs of the student's own tokens as a dense per-token signal.

The student samples; a teacher scores each sampled token; the per-token difference
``d_t = log pi_student(a_t) - log pi_teacher(a_t)`` is a one-sample estimate of the reverse KL
``KL(pi_student || pi_teacher)`` at that prefix, and ``opd_kl_coef * d_t`` is subtracted from the token's
advantage. That makes distillation orthogonal to the estimator: on top of GRPO it pulls the policy toward the
teacher while the reward still ranks answers; with a constant reward (every group's advantages 0) it is pure
distillation. Applied after the estimator and before whitening, on the learner's pi_old when the step computes it
(else the engine's log-probs), as slime's ``apply_opd_kl_to_advantages``.

A single ``d_t`` can be negative (the teacher liked the token more than the student did); only its expectation
over the student's samples is a KL. The metrics report its mean over trained tokens per teacher.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from policies.packing import as_float_mask, check_finite, check_packed, zero_masked

__all__ = ["opd_advantages", "reverse_kl_means"]


def opd_advantages(advantages: Tensor, *, student_log_probs: Tensor, teacher_log_probs: Tensor, coef: float,
                   loss_mask: Tensor, response_lengths: Tensor) -> Tensor:
    """``advantages - coef * (student - teacher)`` on trained tokens, 0 elsewhere; all tensors packed ``[T]``."""
    check_packed("student log-probs (pi_old or the engine's)", student_log_probs, response_lengths)
    check_packed("teacher_log_probs", teacher_log_probs, response_lengths)
    mask = as_float_mask(loss_mask, advantages.dtype)
    check_finite("teacher_log_probs", teacher_log_probs, mask)
    check_finite("student log-probs (pi_old or the engine's)", student_log_probs, mask)
    reverse_kl = zero_masked(student_log_probs.to(advantages.dtype) - teacher_log_probs.to(advantages.dtype), mask)
    return zero_masked(advantages - coef * reverse_kl, mask)


def reverse_kl_means(student_log_probs: Tensor, teacher_log_probs: Tensor, loss_mask: Tensor,
                     response_lengths: Tensor, teachers: Sequence[str]) -> dict[str, float]:
    """Mean sampled reverse KL per trained token: over the batch (``opd/reverse_kl``) and per teacher
    (``opd/reverse_kl/NAME``, with that teacher's trained tokens as ``opd/tokens/NAME``)."""
    mask = as_float_mask(loss_mask, torch.float64)
    difference = zero_masked(student_log_probs.double() - teacher_log_probs.double(), mask)
    owners = torch.repeat_interleave(torch.arange(len(teachers)), response_lengths.cpu())
    metrics = {"opd/reverse_kl": float(difference.sum() / mask.sum().clamp_min(1))}
    for name in dict.fromkeys(teachers):
        mine = torch.tensor([teacher == name for teacher in teachers])[owners]
        tokens = mask[mine].sum()
        metrics[f"opd/reverse_kl/{name}"] = float(difference[mine].sum() / tokens.clamp_min(1))
        metrics[f"opd/tokens/{name}"] = float(tokens)
    return metrics
