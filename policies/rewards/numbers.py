"""A numeric final answer (``--rm-type final_number``): arithmetic, counting, word problems with a number as answer.

Chat models answer "What is 23 + 14?" in many shapes: ``37``, ``23 + 14 = 37.``, ``The answer is **37**``,
``\\boxed{37}``. The answer read is the last ``\\boxed{}`` if there is one, else the number after the last "=", else
the last number of the response, so a model is scored on the number it gives, not on its phrasing. A response cut
off at the length limit has given no final answer (as DeepScaleR's reward treats truncation).

- ``final_number``: 1.0 for the right number in a response the model ended itself, else 0.0.
- ``final_number_brief``: the same, but a right answer with words around it scores 0.5, the bare number 1.0: for
  prompts that ask for just the number. The model first learns to be right in whatever words it likes, then to
  drop them, which also makes every later step cheaper (SmolLM2 writes "23 + 14 = 37" in 11 tokens, "37" in 3).

Both say the parts apart: ``correct`` (the right number in an ended response: the task's accuracy, whatever the
words), ``format_ok`` (the response is exactly the answer, a number or a boxed one) and ``truncated``; the learner
logs each as ``reward/<name>``, the eval rounds as ``eval/<set>/reward/<name>``.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from policies.registry import register_reward
from policies.rewards.math_answers import extract_boxed
from policies.rewards.runner import runs_inline
from policies.rewards.types import RewardInput

__all__ = ["final_number", "final_number_brief_reward", "final_number_reward", "parse_number"]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_AFTER_EQUALS = re.compile(r"=\s*\**\s*\$?\s*(-?\d[\d,]*(?:\.\d+)?(?:/\d+)?)")
_BARE = re.compile(r"\s*\**\s*\$?\s*(\\boxed\{[^{}]*\}|-?\d[\d,]*(?:\.\d+)?(?:/\d+)?)\s*\$?\s*\**\s*\.?\s*")


def parse_number(text: str) -> Fraction | None:
    """``"1,234"``, ``"-3.50"``, ``"7/2"`` as exact fractions; None when the text is not one number."""
    text = text.strip().replace(",", "").rstrip(".")
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def final_number(response: str) -> str | None:
    """The answer the response gives (see the module docstring), as it is written; None when it has no number."""
    text = response.rsplit("</think>", 1)[-1]
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    after_equals = _AFTER_EQUALS.findall(text)
    if after_equals:
        return after_equals[-1]
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


@register_reward("final_number")
@runs_inline
def final_number_reward(inp: RewardInput) -> dict[str, Any]:
    parts = _judged(inp)
    return {"reward": 1.0 if parts["correct"] else 0.0, **parts}


@register_reward("final_number_brief")
@runs_inline
def final_number_brief_reward(inp: RewardInput) -> dict[str, Any]:
    parts = _judged(inp)
    return {"reward": (1.0 if parts["format_ok"] else 0.5) if parts["correct"] else 0.0, **parts}


def _judged(inp: RewardInput) -> dict[str, bool]:
    gold = parse_number(str(inp.label))
    if gold is None:
        raise ValueError(f"label: final_number expects a number, got {inp.label!r}")
    answer = final_number(inp.response)
    given = None if answer is None else parse_number(answer)
    truncated = inp.finish_reason == "length"
    return {"correct": given is not None and given == gold and not truncated,
            "format_ok": _BARE.fullmatch(inp.response.rsplit("</think>", 1)[-1]) is not None,
            "truncated": truncated}
