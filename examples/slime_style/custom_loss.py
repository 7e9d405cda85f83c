"""A custom loss in slime's style: ``loss(args, batch, logits, sum_of_sample_mean) -> (loss, metrics)``.

A REINFORCE loss with a clipped importance weight toward pi_old. Run with ``--loss-type
examples.slime_style.custom_loss:reinforce_loss`` (slime: ``--loss-type custom_loss --custom-loss-function-path``).
One change from slime: our trainer hands per-sample log-probs with gradient in ``batch["log_probs"]`` (``logits``
is None), so the loss reads them instead of calling slime's ``get_log_probs_and_entropy``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def reinforce_loss(args: Any, batch: dict[str, Any], logits: Any,
                   sum_of_sample_mean: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, dict]:
    log_probs = torch.cat(batch["log_probs"])
    old = torch.cat(batch["old_log_probs"])
    advantages = torch.cat(batch["advantages"])
    weight = (log_probs.detach() - old).exp().clamp(max=2.0)
    loss = -sum_of_sample_mean(weight * log_probs * advantages)
    return loss, {"is_weight_mean": sum_of_sample_mean(weight).detach()}
