"""slime's ``--custom-pg-loss-reducer-function-path``: a factory
``fn(total_lengths, response_lengths, loss_masks, calculate_per_token_loss) -> reducer`` whose
``reducer(pg_loss) -> scalar`` replaces the reduction of the policy-gradient term only (slime's documented use:
Dr.GRPO, dividing each sample's token sum by a constant instead of its length).

slime builds the reducer per micro-batch from that micro-batch's samples and hands it the packed per-token loss
after the off-policy correction (the masks are those left after the correction's rejections); its scalar is the
micro-batch's numerator, which slime's loss then divides by the step's samples (its tokens with
``--calculate-per-token-loss``). Here that scalar is the numerator of the term in ``policies.losses`` and the
step's ``--loss-agg-mode`` denominator divides it, so the same function gives the same term. ``total_lengths``
(prompt + response) are not known to the loss; slime reads them only to cut rows under context parallelism, and
they are given as the response lengths.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from actors.config import RunConfig
from policies.plugins import load_callable

FLAG = "--custom-pg-loss-reducer-function-path"


def load_pg_loss_reducer(config: RunConfig) -> SlimePgReducer | None:
    path = config.learner.custom_pg_loss_reducer_function_path
    if not path:
        return None
    return SlimePgReducer(factory=load_callable(path, what=FLAG), path=path,
                          per_token=config.policy.loss_agg_mode == "token-mean")


@dataclass(frozen=True)
class SlimePgReducer:
    """The factory, called per micro-batch as slime calls it; `policies.losses.PgReducer`'s signature."""

    factory: Callable[..., Any]
    path: str
    per_token: bool  # slime's calculate_per_token_loss: --loss-agg-mode token-mean

    def __call__(self, per_token_loss: Tensor, mask: Tensor, response_lengths: Tensor) -> Tensor:
        lengths = [int(n) for n in response_lengths.tolist()]
        masks = list(torch.split(mask, lengths))
        reducer = self.factory(lengths, lengths, masks, self.per_token)
        if not callable(reducer):
            raise TypeError(f"{FLAG} {self.path!r}: returned {type(reducer).__name__}, expected the reducer "
                            "(a function of the packed per-token loss)")
        value = reducer(per_token_loss)
        if not isinstance(value, Tensor) or value.numel() != 1:
            shown = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(f"{FLAG} {self.path!r}: the reducer returned {shown}, expected a scalar tensor")
        return value.reshape(())
