"""Multi-turn samples kept as tokens: what the model generated is never re-tokenised, and what the template adds
between its turns is computed once per tokenizer, against an anchor conversation.

Why not render the whole conversation again at the end: chat templates are not append-only. Qwen3-style templates
drop the `<think>` part of earlier assistant turns, some merge consecutive tool results into one turn, and a
tokenizer may merge text across a turn boundary differently than the engine did. Re-rendering then trains on a
sequence the model never produced, with a loss mask that no longer lines up with its own tokens.

So a multi-turn generate function builds a `Trajectory`: the model's tokens go in as the engine returned them
(loss mask 1, their log-probs and weight versions), and everything else (the end of a turn the model stopped on
a stop string, the tool results, the next generation prompt) goes in as the template's tokens for those
messages alone (`ChatTurns`), with loss mask 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from actors.data.loss_masks import render
from actors.rollout.generate import Tokenizer, make_sample
from bus.schema import PromptGroup, Sample

ANCHOR_TEXT = "anchor"  # plain text that any tokenizer encodes the same alone and inside a turn
ANCHOR_USER = {"role": "user", "content": ANCHOR_TEXT}
ANCHOR_ASSISTANT = {"role": "assistant", "content": ANCHOR_TEXT}


class TemplateNotIncremental(ValueError):
    """The chat template renders an anchor conversation differently once messages follow it: the tokens of new
    messages cannot be told apart from the ones before them."""


@dataclass(frozen=True)
class ChatTurns:
    """What a tokenizer's chat template puts around a model turn, read off an anchor conversation once."""

    tokenizer: Tokenizer
    turn_end: tuple[int, ...]  # the template's tokens after an assistant message's text, e.g. <|im_end|> "\n"
    anchor: tuple[int, ...]  # the anchor conversation (a user turn, an answered assistant turn), rendered
    tools: tuple[Mapping[str, Any], ...] | None = None
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, *, tools: Sequence[Mapping[str, Any]] | None = None,
                      **template_kwargs: Any) -> ChatTurns:
        asked = render(tokenizer, [ANCHOR_USER], add_generation_prompt=True, tools=tools, **template_kwargs)
        answered = render(tokenizer, [ANCHOR_USER, ANCHOR_ASSISTANT], add_generation_prompt=False, tools=tools,
                          **template_kwargs)
        text = list(tokenizer(ANCHOR_TEXT, add_special_tokens=False)["input_ids"])
        if answered[:len(asked)] != asked or answered[len(asked):len(asked) + len(text)] != text:
            raise TemplateNotIncremental(
                "the chat template does not render an assistant turn as its generation prompt followed by the "
                f"message's text ({ANCHOR_TEXT!r}), so a model turn cannot be placed in it token for token")
        turn_end = tuple(answered[len(asked) + len(text):])
        if not turn_end:
            raise TemplateNotIncremental("the chat template closes an assistant turn with nothing: turns cannot be "
                                         "told apart")
        return cls(tokenizer, turn_end, tuple(answered), tuple(tools) if tools is not None else None,
                   dict(template_kwargs))

    def closing(self, generated: Sequence[int]) -> list[int]:
        """The template's end of a model turn that the model did not write itself: the rest after its end-of-turn
        token when it stopped on it, the whole ending when it stopped on a stop string or ran out of tokens."""
        if generated and generated[-1] == self.turn_end[0]:
            return list(self.turn_end[1:])
        return list(self.turn_end)

    def next_turn(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The tokens of `messages` (tool results, a user's reply: everything between two model turns, at once)
        after a closed assistant turn, through the next generation prompt."""
        if not messages:
            raise ValueError("next_turn needs the messages between two model turns; got none")
        after = render(self.tokenizer, [ANCHOR_USER, ANCHOR_ASSISTANT, *messages], add_generation_prompt=True,
                       tools=self.tools, **self.template_kwargs)
        if tuple(after[:len(self.anchor)]) != self.anchor:
            roles = [m.get("role") for m in messages]
            raise TemplateNotIncremental(f"the chat template renders the turns before {roles} differently once "
                                         "they follow, so their tokens cannot be appended alone")
        return after[len(self.anchor):]


@dataclass
class Trajectory:
    """One multi-turn sample as the engine saw it: the prompt, then model and environment tokens in order."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    model_turns: int = 0

    @property
    def token_count(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def add_model(self, ids: Sequence[int], log_probs: Sequence[float], versions: Sequence[int]) -> None:
        """The engine's output for one turn, as returned: trained on (loss mask 1)."""
        if not len(ids) == len(log_probs) == len(versions):
            raise ValueError(f"a model turn needs one log-prob and one weight version per token; got {len(ids)} "
                             f"tokens, {len(log_probs)} log-probs, {len(versions)} versions")
        self._extend(ids, 1, log_probs, versions)
        self.model_turns += 1

    def add_environment(self, ids: Sequence[int]) -> None:
        """Tokens the model did not write (loss mask 0). They carry the version of the token before them, so they
        never make a sample look staler than the model's tokens around it."""
        version = self.versions[-1] if self.versions else 0
        self._extend(ids, 0, [0.0] * len(ids), [version] * len(ids))

    def truncate(self, response_length: int) -> None:
        """Drop what came after the first `response_length` response tokens: the context appended for a model turn
        that never came (the conversation no longer fit the engine)."""
        if any(self.loss_mask[response_length:]):
            raise ValueError("truncating would drop model tokens; only the environment's trailing tokens may go")
        for values in (self.response_ids, self.loss_mask, self.log_probs, self.versions):
            del values[response_length:]

    def to_sample(self, group: PromptGroup, index: int, *, response: str, status: str,
                  metadata: dict[str, Any] | None = None, messages: list[dict[str, Any]] | None = None) -> Sample:
        """`messages`: the conversation as chat messages, when it is a chat (`Sample.messages`)."""
        turns = {"turns": self.model_turns, "environment_tokens": self.loss_mask.count(0)}
        return make_sample(group, index, self.prompt_ids, self.response_ids, self.log_probs, self.versions,
                           response=response, status=status, loss_mask=self.loss_mask,
                           metadata={**turns, **(metadata or {})}, messages=messages)

    def _extend(self, ids: Sequence[int], mask: int, log_probs: Sequence[float], versions: Sequence[int]) -> None:
        self.response_ids.extend(int(i) for i in ids)
        self.loss_mask.extend([mask] * len(ids))
        self.log_probs.extend(float(p) for p in log_probs)
        self.versions.extend(int(v) for v in versions)
