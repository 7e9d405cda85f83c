"""Per-token log-probs and entropy of the sampling distribution softmax(logits / temperature).

The inference engine reports exactly `log_softmax(logits / T)` at the sampled token, so the learner must divide
by the same temperature before normalising; otherwise the importance ratios between the two are biased by
construction. Reductions run in float32 even when the model computes in bfloat16.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engines.training.base import ModelOutputs


def token_log_probs(logits: Tensor, targets: Tensor, *, temperature: float, with_entropy: bool) -> ModelOutputs:
    """`logits` [N, V] at the positions that predict `targets` [N]."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    scaled = logits.float()
    if temperature != 1.0:
        scaled = scaled / temperature
    log_probs_all = torch.log_softmax(scaled, dim=-1)
    log_probs = log_probs_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        entropy = -(log_probs_all.exp() * log_probs_all).sum(-1)
    return ModelOutputs(log_probs=log_probs, entropy=entropy)
