"""Reward functions for the reward worker's tests, loaded by `--custom-rm-path` like a user's."""

from __future__ import annotations

import itertools
from typing import Any

from actors.slime_compat import Sample
from policies.rewards import RewardInput, prompt_text

SEEN: list[RewardInput] = []  # what `record` was given, in call order (in-process runs only)
SEEN_SLIME: list[Sample] = []  # what `record_slime` was given


def record(inp: RewardInput) -> float:
    SEEN.append(inp)
    return 0.0


def record_slime(args: Any, sample: Sample) -> float:
    SEEN_SLIME.append(sample)
    return 0.0


def always_raises(inp: RewardInput) -> float:
    raise ValueError(f"cannot grade label {inp.label!r}")


def fails_unless_ok(inp: RewardInput) -> float:
    """Scores a response "ok", fails on any other: a reward that fails often, not always."""
    if inp.response != "ok":
        raise ValueError(f"flaky judge: cannot read {inp.response!r}")
    return 1.0


def digit_share(inp: RewardInput) -> float:
    """The share of the response's characters that are digits: varies between an untrained model's samples, so a
    GRPO group has advantages (and a gradient) without a model that can do the task."""
    return sum(character.isdigit() for character in inp.response) / max(1, len(inp.response))


def digits_graded_each(inp: RewardInput) -> dict[str, Any]:
    """`digit_share`, with each character graded as a step of its own (1 for a digit): a process reward whose steps
    vary within every sample, so grpo_process has something to credit whatever an untrained model writes."""
    steps = [[end, float(character.isdigit())] for end, character in enumerate(inp.response, start=1)]
    return {"reward": digit_share(inp), "step_rewards": steps}


def letter_share(inp: RewardInput) -> float:
    """The share of the response's characters that are letters: another reward that varies between an untrained
    model's samples, for a second policy whose groups must be scored by its own reward."""
    return sum(character.isalpha() for character in inp.response) / max(1, len(inp.response))


def odd_first_operand(inp: RewardInput) -> float:
    """1 when the prompt's first number is odd, whatever the response: returns that a value model learns from the
    prompt alone (a critic's test), where an untrained model's answers would score all 0."""
    digits = "".join(itertools.takewhile(str.isdigit, prompt_text(inp.prompt).lstrip()))
    return float(int(digits or "0") % 2)


def counts_segments(inp: RewardInput) -> float:
    """Records what it is given and scores an episode by how many segments it was: a reward that tells whose
    input it read."""
    SEEN.append(inp)
    return float(len(inp.segments or []))
