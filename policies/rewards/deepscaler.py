"""DeepScaleR-style reward: format first, then correctness (``--rm-type deepscaler``).

The response must close its reasoning with ``</think>`` and then give a ``\\boxed{}`` answer; only a well-formed
AND correct response earns 1.0. Rewarding format separately invites the policy to learn the format alone, so a
format failure scores the same 0.0 as a wrong answer; the extras tell them apart in the logs.
"""

from __future__ import annotations

from typing import Any

from policies.registry import register_reward
from policies.rewards.math_answers import extract_boxed, math_answers_match
from policies.rewards.types import RewardInput

__all__ = ["deepscaler_reward"]


@register_reward("deepscaler")
def deepscaler_reward(inp: RewardInput) -> dict[str, Any]:
    if "</think>" not in inp.response:
        return {"reward": 0.0, "format_ok": False, "correct": False}
    answer = extract_boxed(inp.response.rsplit("</think>", 1)[1])
    if answer is None:
        return {"reward": 0.0, "format_ok": False, "correct": False}
    golds = inp.label if isinstance(inp.label, (list, tuple)) else [inp.label]
    correct = any(math_answers_match(answer, str(gold)) for gold in golds)
    return {"reward": 1.0 if correct else 0.0, "format_ok": True, "correct": correct}
