"""What a reward function of ours is given for a sample off the wire: the `RewardInput` of an episode."""

from __future__ import annotations

from bus.schema import FINISH_BY_STATUS, Sample
from policies.rewards.types import RewardInput, prompt_text

__all__ = ["reward_input"]


def reward_input(sample: Sample, segments: list[Sample] | None = None) -> RewardInput:
    """What a reward function of ours is given for one wire sample (an episode's final segment, with all of
    `segments`): text, label, metadata, token ids, the engine's finish reason (carried by the sample's status) and
    a chat episode's messages, each segment's."""
    tokens = sample.tokens.tolist()
    messages = None if sample.messages is None else [dict(message) for message in sample.messages]
    chats = [segment.messages for segment in segments or [sample]]
    return RewardInput(prompt=prompt_text(sample.prompt), response=sample.response, label=sample.label,
                       metadata=dict(sample.metadata), prompt_ids=tokens[:sample.prompt_tokens],
                       response_ids=tokens[sample.prompt_tokens:],
                       finish_reason=FINISH_BY_STATUS.get(sample.status),  # type: ignore[arg-type]
                       messages=messages,
                       segments=None if messages is None else [[dict(m) for m in chat or []] for chat in chats])
