"""slime's geo3k reward (``--rm-type geo3k``): geometry answers checked by math-verify, plus a small format bonus.

Geometry3K's answers are LaTeX (``3\\sqrt{3}``, ``\\frac{40}{3}``, ``60``). slime scores a response
``0.9 * correct + 0.1 * format``: correct when the last ``\\boxed{}`` answer equals the label, format when the
response is ``<think>...</think>`` followed by a boxed answer. The weights and the format rule are slime's; the
equality is math-verify's (as ``--rm-type math``), where slime normalises strings for sympy, so equivalent
spellings (``\\frac{1}{2}`` and ``0.5``) agree here too.
"""

from __future__ import annotations

import re
from typing import Any

from policies.registry import register_reward
from policies.rewards.math_answers import extract_boxed, label_text, math_answers_match
from policies.rewards.types import RewardInput

__all__ = ["FORMAT_WEIGHT", "geo3k_reward"]

FORMAT_WEIGHT = 0.1  # slime's share of the reward paid for the format alone
_THINK_THEN_BOX = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


@register_reward("geo3k")
def geo3k_reward(inp: RewardInput) -> dict[str, Any]:
    """``0.9 * correct + 0.1 * format_ok`` with both parts as extras, so the logs tell a right answer in the wrong
    shape (0.9) from a well-shaped wrong one (0.1)."""
    answer = extract_boxed(inp.response)
    correct = answer is not None and math_answers_match(answer, label_text(inp.label))
    format_ok = _THINK_THEN_BOX.fullmatch(inp.response) is not None
    return {"reward": (1.0 - FORMAT_WEIGHT) * correct + FORMAT_WEIGHT * format_ok, "correct": correct,
            "format_ok": format_ok}
