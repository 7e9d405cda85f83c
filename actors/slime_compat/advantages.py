"""slime's ``--custom-advantage-function-path``: ``fn(args, rollout_data)`` fills the advantages and returns.

slime calls the function inside ``compute_advantages_and_returns``, on one data-parallel rank's samples, in place
of its estimator; here the learner's advantages stage calls :class:`SlimeAdvantageFunction` in place of
``policies.advantages.compute_advantages``. ``rollout_data`` is built as slime hands it over: per-sample lists
``tokens``, ``response_lengths``, ``total_lengths``, ``loss_masks`` (int tensors), ``rewards`` (floats, already
post-processed as slime's rollout manager does: group-normalised for grpo/gspo/cispo/reinforce_plus_plus_baseline
unless rewards normalisation is off, e.g. under a reward post-process or a convert hook), ``kl`` (per token,
``kl_loss_type`` of log_probs against ref_log_probs, zeros when ``kl_coef == 0``, unmasked as in slime),
and, when this step has them, ``log_probs``, ``ref_log_probs``, ``rollout_log_probs`` and ``entropy``
(``--use-rollout-entropy``: per token, under the policy before the step). There is no critic, so no
``values``. ``log_probs`` is pi_old when the step computed it (always when ``kl_coef != 0``), else the engine's
log-probs, which is what pi_old is on that path (or what the training forward reproduces at version parity).

Tensors are copies: a plugin that edits them in place changes nothing the loss reads. What comes back is checked
(one finite per-token tensor per sample, on trained tokens), then masked and, with ``--normalize-advantages``,
whitened across the data-parallel ranks, as slime whitens after its hook. Each rank holds whole groups, so the
group normalisation of the rewards needs no other rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from actors.config import RunConfig
from actors.slime_compat.args import build_args
from engines.training.base import TrainSample
from policies.advantages import group_normalize, whiten
from policies.config import PolicyLossConfig
from policies.kl import compute_kl
from policies.packing import zero_masked
from policies.plugins import load_callable

__all__ = ["FLAG", "SlimeAdvantageFunction", "load_custom_advantages", "slime_rewards"]

FLAG = "--custom-advantage-function-path"
# The estimators whose rewards slime's rollout manager group-normalises before training (`_post_process_rewards`).
_GROUP_NORMALISED = ("grpo", "gspo", "cispo", "reinforce_plus_plus_baseline")
_STD_NORMALISED = ("grpo", "gspo", "cispo")


def load_custom_advantages(config: RunConfig) -> SlimeAdvantageFunction | None:
    """The configured slime advantage function, loaded and checked now (a typo fails at start-up), or None."""
    path = config.learner.custom_advantage_function_path
    if not path:
        return None
    fn = load_callable(path, what=FLAG)
    return SlimeAdvantageFunction(fn=fn, args=build_args(config), path=path)


def slime_rewards(policy: PolicyLossConfig, rewards: Tensor, group_ids: Tensor) -> Tensor:
    """The rewards slime's default post-process hands to training: group-centred (and divided by the group's std
    for the GRPO family with std normalisation) for the estimators slime normalises, else as they are."""
    if not policy.rewards_normalization or policy.advantage_estimator not in _GROUP_NORMALISED:
        return rewards
    divide = policy.grpo_std_normalization and policy.advantage_estimator in _STD_NORMALISED
    return group_normalize(rewards, group_ids, divide_by_std=divide, eps=policy.reward_norm_eps)


@dataclass(frozen=True)
class SlimeAdvantageFunction:
    """A slime ``fn(args, rollout_data)`` as the advantages of one shard: packed ``[T]``, masked, maybe whitened."""

    fn: Any
    args: SimpleNamespace
    path: str
    flag: str = FLAG  # the flag that named the function, for its errors

    def __call__(self, policy: PolicyLossConfig, samples: Sequence[TrainSample], group_ids: Tensor, *,
                 process_group: dist.ProcessGroup | None = None) -> Tensor:
        """Every data-parallel rank calls this (whitening is collective), each with its own whole groups."""
        lengths = [s.response_length for s in samples]
        masks = [_mask(s) for s in samples]
        packed_mask = torch.cat(masks) if masks else torch.zeros(0)
        if samples:
            data = self.rollout_data(policy, samples, group_ids)
            self.fn(self.args, data)
            advantages = self._returned(data, "advantages", lengths, masks)
            self._returned(data, "returns", lengths, masks)  # checked like slime's contract; no critic reads them
            packed = torch.cat(advantages)
        else:
            packed = torch.zeros(0)
        packed = zero_masked(packed, packed_mask)
        if policy.normalize_advantages:
            packed = whiten(packed, packed_mask, process_group=process_group, unbiased=policy.whiten_unbiased)
        return packed

    def rollout_data(self, policy: PolicyLossConfig, samples: Sequence[TrainSample],
                     group_ids: Tensor) -> dict[str, Any]:
        """slime's ``rollout_data`` for these samples, in its layout: lists with one entry per sample."""
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)  # set for a rewarded step
        data: dict[str, Any] = {
            "tokens": [s.tokens.clone() for s in samples],
            "response_lengths": [s.response_length for s in samples],
            "total_lengths": [int(s.tokens.numel()) for s in samples],
            "loss_masks": [_mask(s).to(torch.int) for s in samples],
            "rewards": slime_rewards(policy, rewards, group_ids).tolist(),
        }
        for key, field in (("log_probs", "old_log_probs"), ("ref_log_probs", "ref_log_probs"),
                           ("rollout_log_probs", "rollout_log_probs")):
            values = _per_sample(samples, field)
            if values is not None:
                data[key] = values
        entropy = _per_sample(samples, "rollout_entropy")  # --use-rollout-entropy
        if entropy is not None:
            data["entropy"] = entropy
        if "log_probs" not in data and "rollout_log_probs" in data:
            data["log_probs"] = [t.clone() for t in data["rollout_log_probs"]]
        data["kl"] = self._kl(policy, samples, data)
        return data

    def _kl(self, policy: PolicyLossConfig, samples: Sequence[TrainSample], data: dict[str, Any]) -> list[Tensor]:
        if policy.kl_coef == 0:
            return [torch.zeros(s.response_length, dtype=torch.float32) for s in samples]
        if "log_probs" not in data or "ref_log_probs" not in data:
            raise ValueError(f"{self.flag} {self.path!r}: kl_coef={policy.kl_coef} puts a per-token KL into "
                             "rollout_data['kl'], which needs the policy's and the reference model's log-probs")
        return [compute_kl(policy.kl_loss_type, lp, ref).float()
                for lp, ref in zip(data["log_probs"], data["ref_log_probs"], strict=True)]

    def _returned(self, data: dict[str, Any], key: str, lengths: Sequence[int],
                  masks: Sequence[Tensor]) -> list[Tensor]:
        """``data[key]`` as one float32 tensor per sample, or an error naming the plugin and what is wrong."""
        where = f"{self.flag} {self.path!r}: rollout_data[{key!r}]"
        if key not in data:
            raise ValueError(f"{where} was not set; the function must fill rollout_data['advantages'] and "
                             "rollout_data['returns'] with one per-token tensor per sample")
        values = data[key]
        if not isinstance(values, (list, tuple)):
            raise TypeError(f"{where}: expected a list with one per-token tensor per sample, "
                            f"got {type(values).__name__}")
        if len(values) != len(lengths):
            raise ValueError(f"{where} has {len(values)} entries for {len(lengths)} samples")
        out = []
        for index, (value, length, mask) in enumerate(zip(values, lengths, masks, strict=True)):
            try:
                tensor = torch.as_tensor(value).detach().to(device="cpu", dtype=torch.float32)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise TypeError(f"{where}[{index}]: not a tensor of numbers ({exc})") from exc
            if tensor.dim() != 1 or tensor.numel() != length:
                raise ValueError(f"{where}[{index}]: expected {length} values (the sample's response length), "
                                 f"got shape {tuple(tensor.shape)}")
            bad = ~torch.isfinite(tensor) & (mask > 0)
            if bool(bad.any()):
                token = int(bad.nonzero()[0, 0])
                raise ValueError(f"{where}[{index}]: non-finite value {float(tensor[token])} at trained token {token}")
            out.append(tensor)
        return out


def _mask(sample: TrainSample) -> Tensor:
    if sample.loss_mask is None:
        return torch.ones(sample.response_length, dtype=torch.float32)
    return sample.loss_mask.detach().to(device="cpu", dtype=torch.float32)


def _per_sample(samples: Sequence[TrainSample], field: str) -> list[Tensor] | None:
    """Copies of a per-token field of every sample, or None when some sample lacks it."""
    values = [getattr(s, field) for s in samples]
    if any(v is None for v in values):
        return None
    return [v.detach().to(device="cpu", dtype=torch.float32).clone() for v in values]
