"""Math answer checking through math-verify, with ``\\boxed{}`` extraction (``--rm-type math``).

Hand-written string matchers miss LaTeX equivalences (``\\frac12`` = ``0.5`` = ``1/2``); math-verify parses both
sides with sympy. It guards parsing with ``signal.alarm``, which only works on the main thread: there we keep its
timeouts, in a worker thread (where :func:`policies.rewards.score` runs sync rewards) we turn them off and rely on
the runner's ``timeout_s``.
"""

from __future__ import annotations

import threading
from typing import Any

from policies.registry import register_reward
from policies.rewards.types import RewardInput

__all__ = ["braced", "extract_boxed", "label_text", "math_answers_match", "math_reward"]

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_MATH_VERIFY_TIMEOUT_S = 5


def extract_boxed(text: str) -> str | None:
    """Content of the LAST ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 5``) in ``text``, braces balanced.

    The last one, because reasoning models often box intermediate results before the final answer.
    Returns None when there is no complete box.
    """
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    command = next(cmd for cmd in _BOX_COMMANDS if text.startswith(cmd, start))
    rest = text[start + len(command) :]
    if rest.startswith(" "):  # "\boxed 5": the answer runs to the next whitespace or "$"
        token = rest[1:].split("$")[0].split()
        return token[0] if token else None
    content = braced(rest)
    return None if content is None else content.strip()


def braced(text: str) -> str | None:
    """What the brace that opens ``text`` holds, as written (nested braces balanced); None when ``text`` does not
    open with one or it never closes."""
    if not text.startswith("{"):
        return None
    depth = 0
    for i, char in enumerate(text):
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[1:i]
    return None


def math_answers_match(predicted: str, gold: str) -> bool:
    """True when math-verify judges the two LaTeX answers equivalent (either side may be a bare expression)."""
    from math_verify import parse, verify  # imported lazily: sympy takes a second to load

    timeout = _MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold_parsed = parse(_as_latex(gold), parsing_timeout=timeout)
    predicted_parsed = parse(_as_latex(predicted), parsing_timeout=timeout)
    if not gold_parsed or not predicted_parsed:
        return False
    return bool(verify(gold_parsed, predicted_parsed, timeout_seconds=timeout))


@register_reward("math")
def math_reward(inp: RewardInput) -> float:
    """1.0 if the response's last boxed answer equals the label (math-verify), else 0.0 (also when unboxed)."""
    predicted = extract_boxed(inp.response)
    if predicted is None:
        return 0.0
    return 1.0 if math_answers_match(predicted, label_text(inp.label)) else 0.0


def _as_latex(answer: str) -> str:
    boxed = extract_boxed(answer)
    answer = boxed if boxed is not None else answer.strip()
    return answer if answer.startswith("$") else f"${answer}$"


def label_text(label: Any) -> str:
    if isinstance(label, (int, float, str)) and not isinstance(label, bool):
        return str(label)
    raise ValueError(f"label: math reward expects a string or number answer, got {type(label).__name__}")
