"""Reward functions: built-ins selectable by ``--rm-type``, user functions by ``--custom-rm-path``, group rewards
with ``--group-rm``, and one safe runner that turns every failure into an error outcome (see ``runner``)."""

from policies.rewards.inputs import reward_input
from policies.rewards.runner import runs_inline, score, score_group
from policies.rewards.selection import RewardSpec, build_reward
from policies.rewards.types import REWARD_EXTRAS, STEP_REWARDS, RewardInput, RewardOutcome, extras_means, prompt_text

__all__ = ["REWARD_EXTRAS", "STEP_REWARDS", "RewardInput", "RewardOutcome", "RewardSpec", "build_reward",
           "extras_means", "prompt_text", "reward_input", "runs_inline", "score", "score_group"]
