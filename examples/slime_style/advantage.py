"""A slime-style advantage function: per-token discounted returns of a terminal reward with a KL penalty.

slime's signature, loading unchanged with
``--custom-advantage-function-path examples.slime_style.advantage:discounted_return``: it reads slime's
``rollout_data`` (``rewards``, ``kl``, ``loss_masks``) and fills ``rollout_data["advantages"]`` and
``rollout_data["returns"]``, one per-token tensor per sample. It is REINFORCE++ written out by hand: each sample's
reward sits on its last trained token, every trained token pays ``kl_coef * kl``, and the return of a token is
the ``gamma``-discounted sum of what follows it. Whitening (``--normalize-advantages``) is applied after it.
"""

from __future__ import annotations

from typing import Any

import torch


def discounted_return(args: Any, rollout_data: dict[str, Any]) -> None:
    gamma, kl_coef = float(args.gamma), float(args.kl_coef)
    advantages = []
    for reward, kl, mask in zip(rollout_data["rewards"], rollout_data["kl"], rollout_data["loss_masks"],
                                strict=True):
        trained = mask.float()
        token_rewards = -kl_coef * kl.float() * trained
        positions = trained.nonzero()
        if len(positions):
            token_rewards[positions[-1, 0]] += float(reward)
        returns = torch.zeros_like(token_rewards)
        running = torch.zeros((), dtype=token_rewards.dtype)
        for t in reversed(range(token_rewards.numel())):
            running = token_rewards[t] + gamma * running
            returns[t] = running
        advantages.append(returns)
    rollout_data["advantages"] = advantages
    rollout_data["returns"] = [a.clone() for a in advantages]
