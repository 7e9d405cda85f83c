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


DR_GRPO_CONSTANT = 4096.0  # Dr.GRPO's constant: the response budget, the same for every sample


def dr_grpo_reducer(total_lengths: list[int], response_lengths: list[int], loss_masks: list[torch.Tensor],
                    calculate_per_token_loss: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """slime's pg_loss reducer factory (``--custom-pg-loss-reducer-function-path``): each sample's token sum over a
    constant instead of its own length, so long and short answers weigh their tokens alike (Dr.GRPO)."""

    def reduce(pg_loss: torch.Tensor) -> torch.Tensor:
        per_sample = pg_loss.split(response_lengths)
        return sum((x * mask).sum() / DR_GRPO_CONSTANT for x, mask in zip(per_sample, loss_masks, strict=True))

    return reduce
