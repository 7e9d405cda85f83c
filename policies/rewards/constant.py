"""A reward that says nothing: pure on-policy distillation, where the teacher's log-probs are the only signal.

slime's OPD reward post-processing returns 0.0 for every sample; ``--rm-type zero`` is the same, spelled as a
reward, so that a run with ``--use-opd`` and no task reward needs no plugin.
"""

from policies.registry import register_reward
from policies.rewards.runner import runs_inline
from policies.rewards.types import RewardInput


@register_reward("zero")
@runs_inline
def zero_reward(inp: RewardInput) -> float:
    return 0.0
