"""Text-answer rewards: exact match, token F1 (SQuAD-style), multiple-choice letter (GPQA style).

The candidate answer is the last ``\\boxed{}`` if the response has one, else the text after the last
``</think>`` (reasoning models), else the whole response. ``label`` may be one answer or a list of acceptable ones.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Any

from policies.registry import register_reward
from policies.rewards.math_answers import extract_boxed
from policies.rewards.runner import runs_inline
from policies.rewards.types import RewardInput

__all__ = [
    "answer_text",
    "exact_match_reward",
    "extract_choice_letter",
    "f1_reward",
    "multiple_choice_reward",
    "normalize_answer",
    "token_f1",
]

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_CHOICE_LETTERS = "ABCDEFGHIJ"


def answer_text(response: str) -> str:
    boxed = extract_boxed(response)
    if boxed is not None:
        return boxed
    return response.rsplit("</think>", 1)[-1].strip()


def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation and English articles, collapse whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in string.punctuation)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def token_f1(predicted: str, gold: str) -> float:
    predicted_tokens = normalize_answer(predicted).split()
    gold_tokens = normalize_answer(gold).split()
    if not predicted_tokens or not gold_tokens:
        return float(predicted_tokens == gold_tokens)
    overlap = sum((Counter(predicted_tokens) & Counter(gold_tokens)).values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(predicted_tokens)
    recall = overlap / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


@register_reward("exact_match")
@runs_inline
def exact_match_reward(inp: RewardInput) -> float:
    predicted = normalize_answer(answer_text(inp.response))
    return 1.0 if any(predicted == normalize_answer(gold) for gold in _golds(inp.label)) else 0.0


@register_reward("f1")
@runs_inline
def f1_reward(inp: RewardInput) -> float:
    predicted = answer_text(inp.response)
    return max(token_f1(predicted, gold) for gold in _golds(inp.label))


_ANSWER_IS = re.compile(r"answer\s*(?:is|:)?\s*[:\-]?\s*\**\s*\(?([A-J])\)?(?![A-Za-z])", re.IGNORECASE)
_PARENTHESISED = re.compile(r"\(([A-J])\)")


def extract_choice_letter(response: str) -> str | None:
    """The chosen option letter (A-J), trying in order: ``\\boxed{C}``, "answer is (C)"/"Answer: C", the last "(C)",
    a response that is just the letter. Later mentions win within each rule (the final answer comes last)."""
    text = response.rsplit("</think>", 1)[-1]
    boxed = extract_boxed(text)
    if boxed is not None:
        letter = boxed.strip().strip("()").strip()
        if len(letter) == 1 and letter.upper() in _CHOICE_LETTERS:
            return letter.upper()
    for pattern in (_ANSWER_IS, _PARENTHESISED):
        matches = pattern.findall(text)
        if matches:
            return matches[-1].upper()
    stripped = text.strip().strip(".").strip("()")
    if len(stripped) == 1 and stripped.upper() in _CHOICE_LETTERS:
        return stripped.upper()
    return None


@register_reward("gpqa")
@register_reward("multiple_choice")
@runs_inline
def multiple_choice_reward(inp: RewardInput) -> float:
    """1.0 if the extracted letter equals the label (a letter, or a 0-based option index), else 0.0."""
    label = inp.label
    if isinstance(label, int) and not isinstance(label, bool):
        if not 0 <= label < len(_CHOICE_LETTERS):
            raise ValueError(f"label: option index {label} outside 0..{len(_CHOICE_LETTERS) - 1}")
        gold = _CHOICE_LETTERS[label]
    elif isinstance(label, str) and len(label.strip().strip("()")) == 1:
        gold = label.strip().strip("()").upper()
    else:
        raise ValueError(f"label: multiple-choice reward expects a letter or an option index, got {label!r}")
    return 1.0 if extract_choice_letter(inp.response) == gold else 0.0


def _golds(label: Any) -> list[str]:
    golds = label if isinstance(label, (list, tuple)) else [label]
    if not golds or not all(isinstance(g, (str, int, float)) and not isinstance(g, bool) for g in golds):
        raise ValueError(f"label: expected an answer string or a non-empty list of them, got {label!r}")
    return [str(g) for g in golds]
