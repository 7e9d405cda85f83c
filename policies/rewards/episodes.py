"""Rewards an environment gave during an episode (``--rm-type environment_return``).

The built-in episode loop stores each turn's reward from the environment's `step` in the sample's
``metadata["turn_rewards"]``; the episode's reward is their sum (the undiscounted return). A sample without any,
an episode that ended before the environment rewarded a turn, scores 0.
"""

from __future__ import annotations

from policies.registry import register_reward
from policies.rewards.types import RewardInput

__all__ = ["environment_return"]


@register_reward("environment_return")
def environment_return(inp: RewardInput) -> float:
    rewards = inp.metadata.get("turn_rewards") or []
    if not isinstance(rewards, (list, tuple)):
        raise TypeError(f"metadata['turn_rewards'] must be a list of numbers, got {type(rewards).__name__}")
    return float(sum(float(reward) for reward in rewards))
