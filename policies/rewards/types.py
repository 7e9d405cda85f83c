"""The reward function contract, shared by the reward worker, built-ins and user plugins.

A reward function is ``fn(RewardInput) -> float`` or ``async fn(RewardInput) -> float``; it may instead return a
dict with a ``"reward"`` number plus extra fields (logged, e.g. ``{"reward": 1.0, "format_ok": True}``). A group
reward function takes ``list[RewardInput]`` (one prompt's samples) and returns ``list[float | dict]`` of the same
length, for rewards that compare samples (pairwise judges, diversity bonuses).

Besides the decoded text, a reward sees the token ids (``response`` may have special tokens stripped, see
``--rollout-skip-special-tokens``; ``response_ids`` never do) and why generation ended, so it can check for EOS or
penalise truncation; and a multi-turn episode as chat messages, so it can read the tool calls and results without
parsing a chat template's text. An episode is scored once: an agent that rewrote its context trains as several
segments (``bus.episodes``), and the reward sees the final one, with every segment's messages in ``segments``;
each segment then carries that reward.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["REWARD_EXTRAS", "STEP_REWARDS", "FinishReason", "GroupRewardFn", "RewardFn", "RewardInput",
           "RewardOutcome", "RewardValue", "extras_means"]

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class RewardInput:
    """One generated sample to score. ``label`` is the dataset's answer field, in whatever form the task uses.

    ``prompt_ids`` and ``response_ids`` are the token ids the engine saw and produced (a multi-turn generate's
    tool output included); ``response_ids[-1]`` is the EOS token when the model ended the response itself.
    ``finish_reason``: ``"stop"`` (EOS, a stop token id or a stop string), ``"length"`` (cut off at
    ``--rollout-max-response-len`` or the context cap: truncated), ``"abort"``; None where the caller does not know
    (a ``RewardInput`` built by hand). The reward worker fills all three; code that builds inputs from text alone
    may leave them empty.

    ``messages`` is a multi-turn chat episode (an agent's, or the built-in tool loop's) as OpenAI chat messages: the
    prompt's, then each turn through the model's last, an assistant turn's calls as ``tool_calls`` (``id``,
    ``function.name``, ``function.arguments`` as a JSON string), each tool result a ``tool`` message with its
    ``tool_call_id``. None for a sample that is not a chat (one completion, a text-completion session). The text
    in ``response`` is the same conversation rendered by the chat template.

    ``segments`` is every segment's ``messages``, in the order they started, for a chat episode (one entry for an
    episode that never rewrote its context). An agent that dropped or summarised turns, or ran a sub-agent with a
    fresh context, went on in a new segment; the input is the episode's final segment (its ``messages``,
    ``response`` and token ids are that segment's), and the reward it gets is every segment's.
    """

    prompt: str
    response: str
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    messages: list[dict[str, Any]] | None = None
    segments: list[list[dict[str, Any]]] | None = None


def prompt_text(prompt: str | list[dict[str, Any]]) -> str:
    """What a reward function reads as the prompt (`RewardInput.prompt`): the text itself, or a conversation's
    contents, a line each. The reward workers and tools/evaluate.py build it one way."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(str(message.get("content", "")) for message in prompt)


RewardValue = float | int | bool | dict[str, Any]
RewardFn = Callable[[RewardInput], RewardValue | Awaitable[RewardValue]]
GroupRewardFn = Callable[[list[RewardInput]], Sequence[RewardValue] | Awaitable[Sequence[RewardValue]]]


@dataclass(frozen=True)
class RewardOutcome:
    """The result for one sample: ``status == "ok"`` with a finite ``reward``, or ``"error"`` with a ``reason``.

    An errored sample is never given a made-up reward; the buffer leaves it out of its group (or drops the group).
    """

    reward: float | None
    status: Literal["ok", "error"]
    reason: str = ""
    extras: dict[str, Any] = field(default_factory=dict)
    trace: str = field(default="", compare=False)  # the function's traceback when it raised
    # the response's steps, graded (`STEP_REWARDS`): (the character its text ends before, reward), in order
    steps: tuple[tuple[int, float], ...] = ()

    @classmethod
    def ok(cls, reward: float, extras: dict[str, Any] | None = None,
           steps: tuple[tuple[int, float], ...] = ()) -> RewardOutcome:
        return cls(reward=reward, status="ok", extras=extras or {}, steps=steps)

    @classmethod
    def error(cls, reason: str, trace: str = "") -> RewardOutcome:
        return cls(reward=None, status="error", reason=reason, trace=trace)


# The key of a reward's dict that grades the response's steps: [[end, reward], ...], `end` a character offset into
# `RewardInput.response`, ascending (`RewardOutcome.steps`); the reward worker places each step on the token its text
# ends in (`Sample.step_ends`).
STEP_REWARDS = "step_rewards"

# The `Sample.metadata` key a reward's extra fields travel under, from the reward worker to the learner's and the
# eval rounds' metrics (a reward that says format and correctness apart is logged as reward/format_ok, ...).
REWARD_EXTRAS = "reward_extras"


def extras_means(extras: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """The mean of each number or bool extra field, over the samples that report it; other fields are not means."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for fields in extras:
        for name, value in fields.items():
            if isinstance(value, (bool, int, float)) and math.isfinite(value):
                sums[name] = sums.get(name, 0.0) + float(value)
                counts[name] = counts.get(name, 0) + 1
    return {name: sums[name] / counts[name] for name in sums}
