"""Multi-step answers scored on their working (``--rm-type worked_steps``): every intermediate result, in order.

``final_number`` pays for the last number alone, and on SmolLM2's word problems GRPO duly trained the reasoning
away (answers of 120 tokens became one sentence of 37). Here the label is the chain of running results of a
multi-step problem (``[30, 25, 28]``: 23 apples, buy 7, give away 5, find 3) and the response must state each of
them, in order, each as the result of its own sentence ("So Tom has 23 + 7 = 30 apples now."), then end on the
last. Length is not paid for: a right final answer with no working scores nothing, and a long answer scores only
through the results it gets right. A sentence's result is read as ``final_number`` reads an answer (the number
after its last "=", else its last number); sentences whose result is a number the prompt itself gives (restating
"Tom has 23 apples", "he gives 5 away") and repeats of the result just stated are passed over, anything else is a
claim: a wrong one ends the chain, so stating many numbers in the hope of hitting the next one does not pay.
The final answer is the last ``\\boxed{}``, else the last sentence's result (not the number after the response's
last "=", which in worked steps may be an earlier step's).

- ``reward``: the share of the chain stated before the first wrong claim; the last link counts only when the answer
  is right and nothing wrong follows it (so 1.0 exactly when ``correct``). A response cut off at the length limit
  scores 0, as in ``final_number``.
- extras: ``correct`` (the whole chain, and the final answer, in an ended response: the task's accuracy),
  ``steps_stated`` (the share of the chain stated in order) and ``truncated``.
- ``step_rewards`` (for ``--advantage-estimator grpo_process``): each link of the chain but the last, stated right,
  is a step of reward 1 ending with its sentence; the last step runs to the first wrong claim (or to the end of the
  response) and earns 1 exactly when the answer is ``correct``. So a slip in the fourth sentence costs the fourth
  sentence, not the three right ones before it.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from policies.registry import register_reward
from policies.rewards.math_answers import extract_boxed
from policies.rewards.numbers import final_number, parse_number
from policies.rewards.runner import runs_inline
from policies.rewards.types import STEP_REWARDS, RewardInput

__all__ = ["sentence_results", "worked_steps_reward"]

# A list marker at a line's start ("1. ", "2) ", "- ", "Step 3: "): its number is no claim about the problem.
_LIST_MARKER = re.compile(r"^[ \t]*(?:(?:step[ \t]*)?\d+[.):]|[-*•])[ \t]+", re.IGNORECASE | re.MULTILINE)
# A sentence ends at ".", "!" or "?" before white space or the end, or at a line break ("2.5" stays whole).
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")
_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


def sentence_results(text: str) -> list[Fraction]:
    """The number each sentence of `text` arrives at (list markers dropped), in order; sentences with none skipped."""
    return [value for _, value in _results_with_ends(text)]


def _results_with_ends(text: str) -> list[tuple[int, Fraction]]:
    """`sentence_results` with the character offset each sentence ends at. The list markers are blanked, not cut
    out, so the offsets are the text's own."""
    blanked = _LIST_MARKER.sub(lambda marker: " " * len(marker.group()), text)
    results, start = [], 0
    for end in [*(boundary.start() for boundary in _SENTENCE_END.finditer(blanked)), len(blanked)]:
        answer = final_number(blanked[start:end])
        value = None if answer is None else parse_number(answer)
        if value is not None:
            results.append((end, value))
        start = end
    return results


@register_reward("worked_steps")
@runs_inline
def worked_steps_reward(inp: RewardInput) -> dict[str, Any]:
    chain = _chain(inp.label)
    truncated = inp.finish_reason == "length"
    text = inp.response.rsplit("</think>", 1)[-1]
    offset = len(inp.response) - len(text)
    given = {parse_number(n) for n in _NUMBER.findall(inp.prompt)}
    results = _results_with_ends(text)
    stated, broken_at = 0, None
    steps: list[list[float]] = []  # [end, reward]: each link stated before the last, then the one that ends the chain
    for end, result in results:
        if result in given or (stated and result == chain[stated - 1]):
            continue  # a restated fact of the prompt, or the result just stated said again
        if stated < len(chain) and result == chain[stated]:
            stated += 1
            if stated < len(chain):
                steps.append([offset + end, 1.0])
        else:
            broken_at = offset + end
            break
    boxed = extract_boxed(text)
    answer = parse_number(boxed) if boxed is not None else results[-1][1] if results else None
    answered = answer == chain[-1]
    correct = stated == len(chain) and broken_at is None and answered and not truncated
    earned = 0.0 if truncated else (len(chain) if correct else min(stated, len(chain) - 1)) / len(chain)
    # The last step runs to the first wrong claim, or to the end: the final answer and whatever follows it.
    steps.append([broken_at if broken_at is not None else len(inp.response), float(correct)])
    if truncated:  # scored 0 as a whole, the working before the cut is still right or wrong
        steps = [step for step in steps if step[0] < len(inp.response)] + [[len(inp.response), 0.0]]
    return {"reward": earned, "correct": correct, "steps_stated": stated / len(chain), "truncated": truncated,
            STEP_REWARDS: [[int(end), reward] for end, reward in steps if end >= 1]}


def _chain(label: Any) -> list[Fraction]:
    """The label as its chain of results: a list of numbers (or numeric strings), the last the final answer."""
    values = [parse_number(str(v)) for v in label] if isinstance(label, (list, tuple)) and label else [None]
    if any(v is None for v in values):
        raise ValueError(f"label: worked_steps expects a non-empty list of numbers (each step's result, the last "
                         f"the answer), got {label!r}")
    return [v for v in values if v is not None]
