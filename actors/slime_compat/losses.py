"""slime's custom policy loss ``(args, batch, logits, sum_of_sample_mean) -> (loss, log)``, run as one of ours.

Loaded by `actors.extensions.load.policy_loss`, which hands the learner a loss of our signature
``(config, PolicyLossInputs) -> PolicyLossTerms`` whichever convention the user wrote in.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from policies.config import PolicyLossConfig
    from policies.losses import PolicyLossInputs, PolicyLossTerms

__all__ = ["adapt_loss", "is_slime_loss"]


def is_slime_loss(fn: Callable[..., Any]) -> bool:
    """slime's custom loss, told apart by signature: ``args`` first, ``sum_of_sample_mean`` fourth."""
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    return len(names) >= 4 and names[0] == "args" and names[3] == "sum_of_sample_mean"


def adapt_loss(fn: Callable[..., Any]) -> Callable[[PolicyLossConfig, PolicyLossInputs], PolicyLossTerms]:
    """Our loss around a slime custom loss.

    It gets ``args`` (the policy settings under slime's names), ``batch`` with per-sample lists ``log_probs`` (with
    gradient: our trainer hands log-probs, not logits, so ``logits`` is None and the loss reads these instead),
    ``old_log_probs``, ``advantages``, ``loss_masks``, ``response_lengths``, and ``sum_of_sample_mean`` = the
    numerator of ``--loss-agg-mode``. Its scalar L becomes the constant per-token loss L / sum_of_sample_mean(1),
    so our aggregation (which divides by the whole step's count) yields exactly L / count: slime's scaling.
    Off-policy correction weights multiply that constant; use ``--off-policy-correction none`` with such a loss.
    """

    def loss(config: PolicyLossConfig, inputs: PolicyLossInputs) -> PolicyLossTerms:
        import torch  # here, not at the top: the learner's plugin loading must not import torch for a rollout worker

        from policies.losses import PolicyLossTerms

        lengths = [int(n) for n in inputs.response_lengths.tolist()]
        mask = inputs.loss_mask.to(inputs.log_probs.dtype)
        owner = torch.repeat_interleave(torch.arange(len(lengths)), inputs.response_lengths.to(torch.long))

        def split(x: Any) -> list[Any]:
            return list(torch.split(x, lengths))

        def sum_of_sample_mean(x: Any) -> Any:
            """The numerator of --loss-agg-mode (policies.aggregation): token sum, or per-sample sums or means."""
            if config.loss_agg_mode == "token-mean":
                return (x * mask).sum()
            sums = torch.zeros(len(lengths), dtype=x.dtype).index_add(0, owner, x * mask)
            if config.loss_agg_mode == "seq-mean-token-mean":
                sums = sums / torch.zeros(len(lengths), dtype=x.dtype).index_add(0, owner, mask).clamp_min(1)
            return sums.sum()

        batch = {"log_probs": split(inputs.log_probs), "old_log_probs": split(inputs.old_log_probs),
                 "advantages": split(inputs.advantages), "loss_masks": split(inputs.loss_mask),
                 "response_lengths": lengths}
        value, log = fn(SimpleNamespace(**config.model_dump()), batch, None, sum_of_sample_mean)
        ones = sum_of_sample_mean(torch.ones_like(inputs.log_probs)).clamp_min(1e-12)
        per_token = (value / ones) * torch.ones_like(inputs.log_probs)
        # slime's log values are sums over samples (sum_of_sample_mean) that its logger divides by the sample
        # count; divided by the same count here, they read as the per-sample means slime shows.
        extra = {k: (v.detach() if isinstance(v, torch.Tensor) else torch.tensor(float(v))) / ones.detach()
                 for k, v in log.items()}
        return PolicyLossTerms(per_token_loss=per_token, clipped=torch.zeros_like(per_token),
                               ratio=torch.ones_like(per_token), extra_metrics=extra)

    loss.__name__ = getattr(fn, "__name__", "custom_loss")
    return loss
