"""slime's ``--rollout-data-postprocess-path``: ``fn(args, rollout_id, rollout_data)``, called on each
data-parallel rank's samples once the advantages are computed and before the optimizer steps, to change what the
step trains on (slime's documented use: loss masks from the computed values).

``rollout_data`` is the dict slime's advantage hook receives (``actors.slime_compat.advantages``: per-sample
``tokens``, ``loss_masks``, ``rewards``, ``log_probs``, ``ref_log_probs``, ``kl`` ...) with the step's
``advantages`` and ``returns`` (= the advantages: there is no critic) added. What the function leaves in
``loss_masks`` and ``advantages`` is what trains, checked as the advantage hook's output is (one per-token tensor
per sample; masks of 0 and 1); anything else it changes is not read. ``rollout_id`` is the policy version the batch
trains from: slime's 0-based rollout id.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from actors.config import RunConfig
from actors.slime_compat.advantages import SlimeAdvantageFunction
from actors.slime_compat.args import build_args
from engines.training.base import TrainSample
from policies.config import PolicyLossConfig
from policies.plugins import load_callable

FLAG = "--rollout-data-postprocess-path"


def load_rollout_data_postprocess(config: RunConfig) -> RolloutDataPostprocess | None:
    path = config.learner.rollout_data_postprocess_path
    if not path:
        return None
    fn = load_callable(path, what=FLAG)
    return RolloutDataPostprocess(SlimeAdvantageFunction(fn=fn, args=build_args(config), path=path, flag=FLAG))


@dataclass(frozen=True)
class RolloutDataPostprocess:
    """The function, with the advantage hook's view of the samples (building slime's dict, checking the answer)."""

    view: SlimeAdvantageFunction

    def __call__(self, policy: PolicyLossConfig, samples: Sequence[TrainSample], group_ids: torch.Tensor,
                 rollout_id: int) -> None:
        """Call the function on these samples and set their loss masks and advantages to what it left."""
        if not samples:
            return
        lengths = [s.response_length for s in samples]
        data = self.view.rollout_data(policy, samples, group_ids)
        advantages = [(s.advantages if s.advantages is not None else torch.zeros(s.response_length))
                      .detach().to("cpu", torch.float32).clone() for s in samples]
        data["advantages"], data["returns"] = advantages, [a.clone() for a in advantages]
        self.view.fn(self.view.args, rollout_id, data)
        masks = self.view._returned(data, "loss_masks", lengths, [torch.ones(n) for n in lengths])
        for index, mask in enumerate(masks):
            if not bool(((mask == 0) | (mask == 1)).all()):
                raise ValueError(f"{FLAG} {self.view.path!r}: rollout_data['loss_masks'][{index}] holds values "
                                 "other than 0 and 1")
        advantages = self.view._returned(data, "advantages", lengths, masks)
        for sample, mask, advantage in zip(samples, masks, advantages, strict=True):
            kind = sample.loss_mask.dtype if sample.loss_mask is not None else torch.float32
            sample.loss_mask = mask.to(sample.tokens.device, kind)
            sample.advantages = (advantage * mask).to(sample.tokens.device)
