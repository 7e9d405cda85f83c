"""DAPO's math reward (``--rm-type dapo``): the final answer against an integer label, +1 if right and -1 if not.

DAPO trains on DAPO-Math-17k, whose answers are all integers, and slime scores it with verl's scorer
(``slime.rollout.rm_hub.math_dapo_utils``); this is that scorer's behaviour, rewritten. Only a response's last 300
characters are read (MATH-500's longest answer is 159): a long chain of thought costs nothing to check, and an answer
stated early and revised later is not the one scored. Two ways to find the answer:

- The answer line (the default): what follows the last ``Answer:`` (any case, spaces around the colon allowed) up to
  the end of its line. Its normal form (`normalise_final_answer`) must equal the label's, the label read as an
  integer. A response with no such line is wrong, and its ``pred`` is ``[INVALID]``.
- The strict box (``strict_box=True``, slime's retool example): the content of the last ``\\boxed{...}`` within the
  final 100 characters (or from 100 before the last of four pause-token positions), compared as written with the
  label as written: no normalisation, any label. ``pred`` is None when there is no complete box there.

The verdict is slime's dict: ``score`` (1.0 / -1.0), ``acc`` (bool) and ``pred`` (the answer as compared). As a
reward here ``score`` is also the ``reward``, so slime's ``--reward-key score`` reads the same number, and ``acc`` is
logged as ``reward/acc``: the accuracy (the mean reward is ``2 * acc - 1``). Where slime's differs: a label that is
not an integer fails the answer-line mode naming it (slime truncates ``3.5`` to ``3`` and scores against that), a
numeric label is compared in strict mode as its text (slime compares the number with a string: never equal), and a
pause position under 100 starts the window at the text's start (slime's slice wraps around to its end).
"""

from __future__ import annotations

import re
from typing import Any

from policies.registry import register_reward
from policies.rewards.math_answers import braced, label_text
from policies.rewards.runner import runs_inline
from policies.rewards.types import RewardInput

__all__ = ["NO_ANSWER", "dapo_reward", "dapo_verdict", "normalise_final_answer"]

READ_CHARS = 300  # the tail of a response that is scored at all
BOX_WINDOW_CHARS = 100  # the tail the strict box must lie in
PAUSE_POSITIONS = 4
NO_ANSWER = "[INVALID]"

_ANSWER_LINE = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)
_BOX = "\\boxed"

# Minerva's final-answer normal form (Lewkowycz et al. 2022, appendix; lm-evaluation-harness's hendrycks_math),
# applied in this order to what follows the last "=". Plain replacements first: articles and spaces go (so "an "
# inside a word goes too, as in Minerva's), \mbox is \text, "and" in a list is a comma, a metre unit is no unit.
_REPLACED = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
             (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
# Then units, filler and end-of-text tokens are deleted wherever they occur.
_DELETED = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
            "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
            "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
            "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;",
            r",\!", "{,}", '"', "\\dots", "<|im_end|>", "<|endoftext|>")
# Then LaTeX is reduced: a line's first $...$ span stands for the line; \text, \textbf and \overline give their first
# argument; \boxed gives everything up to the line's last brace; \fracab and \sqrta get their braces.
_REWRITTEN = ((re.compile(r"[^\n]*?\$([^\n]*?)\$[^\n]*"), r"$\1$"),
              (re.compile(r"\\text\{([^\n]*?)\}"), r"\1"),
              (re.compile(r"\\textbf\{([^\n]*?)\}"), r"\1"),
              (re.compile(r"\\overline\{([^\n]*?)\}"), r"\1"),
              (re.compile(r"\\boxed\{([^\n]*)\}"), r"\1"),
              (re.compile(r"frac([^{])([^\n])"), r"frac{\1}{\2}"),
              (re.compile(r"sqrt([^{])"), r"sqrt{\1}"))


def normalise_final_answer(answer: str) -> str:
    """The form two final answers are compared in: ``"$\\frac12$ cm"`` and ``"x = \\frac{1}{2}"`` both give
    ``\\frac{1}{2}``, ``"1,000 dollars"`` gives ``1000`` (the rules are listed above, in the order they apply)."""
    text = str(answer).rsplit("=", 1)[-1]
    for old, new in _REPLACED:
        text = text.replace(old, new)
    for dropped in _DELETED:
        text = text.replace(dropped, "")
    for pattern, replacement in _REWRITTEN:
        text = pattern.sub(replacement, text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def dapo_verdict(response: str, label: Any, *, strict_box: bool = False,
                 pause_positions: list[int] | None = None) -> dict[str, Any]:
    """slime's ``{"score", "acc", "pred"}`` for one response (the module docstring says how it is judged)."""
    tail = response[-READ_CHARS:]
    if strict_box:
        pred = _last_box(_box_window(tail, pause_positions))
        correct = pred is not None and pred == str(label)
    else:
        lines = _ANSWER_LINE.findall(tail)
        pred = normalise_final_answer(lines[-1] if lines else NO_ANSWER)
        correct = pred == _integer_label(label)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


@register_reward("dapo")
@runs_inline
def dapo_reward(inp: RewardInput) -> dict[str, Any]:
    """The answer-line mode; ``boxed_dapo`` (a ``boxed_`` rm type) reads the answer line inside the last box."""
    verdict = dapo_verdict(inp.response, label_text(inp.label))
    return {"reward": verdict["score"], **verdict}


def _box_window(text: str, pause_positions: list[int] | None) -> str:
    if pause_positions is None:
        return text[-BOX_WINDOW_CHARS:]
    if len(pause_positions) != PAUSE_POSITIONS:
        raise ValueError(f"pause_tokens_index: {PAUSE_POSITIONS} positions expected (slime's), got "
                         f"{len(pause_positions)}: {pause_positions!r}")
    return text[max(0, pause_positions[-1] - BOX_WINDOW_CHARS):]


def _last_box(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` as written (not stripped: the strict mode compares it verbatim)."""
    start = text.rfind(_BOX + "{")
    return None if start < 0 else braced(text[start + len(_BOX):])


def _integer_label(label: Any) -> str:
    normal = normalise_final_answer(str(label))
    try:
        value = float(normal)
    except ValueError:
        value = float("nan")
    if not value.is_integer():
        raise ValueError(f"label: dapo's answer line is compared with an integer label (DAPO-Math's answers are "
                         f"integers), got {label!r}; strict box mode compares any label as written")
    return str(int(value))
