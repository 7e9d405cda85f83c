"""A reward's graded steps, placed on the response tokens they end on (process supervision).

A reward function reads text and grades its steps by character offset (`policies.rewards.STEP_REWARDS`); the
learner credits tokens. Only the run's tokenizer knows which token a character falls in, and the reward worker is
the one role that sees both the offsets and the token ids, so the placing happens here, with the tokenizer of
--hf-checkpoint loaded at the first reward that grades steps (a run whose rewards never do loads none).

A step ends on the first token whose decoding reaches the step's last character: the token that completes the
step's text, so the step's credit covers every token that wrote it. A step that runs to the end of the text ends on
the response's last token, so an end-of-sequence token that decoding leaves out (--rollout-skip-special-tokens) is
credited with the step that ends the answer, as an outcome reward credits it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["StepPlacer", "token_ends"]


def token_ends(decode: Callable[[Sequence[int]], str], response_ids: Sequence[int], response: str,
               char_ends: Sequence[int]) -> np.ndarray:
    """The index among `response_ids` of the token each step ends on (int32); a ValueError when `response` is not
    the ids' decoding (the offsets would point into other text) or an offset falls outside it."""
    ids = list(response_ids)
    if not ids:
        raise ValueError("step_rewards: the response has no tokens to place steps on")
    if decode(ids) != response:
        raise ValueError("step_rewards: the response text is not its token ids decoded (a rewritten or multi-turn "
                         "response?), so character offsets cannot be placed on tokens")
    decoded_lengths: dict[int, int] = {len(ids): len(response)}

    def length(count: int) -> int:
        if count not in decoded_lengths:
            decoded_lengths[count] = len(decode(ids[:count]))
        return decoded_lengths[count]

    ends = []
    for end in char_ends:
        if not 1 <= end <= len(response):
            raise ValueError(f"step_rewards: a step ends at character {end}, outside the response's "
                             f"1..{len(response)}")
        if end == len(response):  # to the end: the last token, an end-of-sequence token the text leaves out included
            ends.append(len(ids) - 1)
            continue
        low, high = 1, len(ids)  # the fewest tokens whose decoding reaches `end` characters
        while low < high:
            middle = (low + high) // 2
            if length(middle) >= end:
                high = middle
            else:
                low = middle + 1
        ends.append(low - 1)
    return np.maximum.accumulate(np.asarray(ends, dtype=np.int32)) if ends else np.zeros(0, dtype=np.int32)


class StepPlacer:
    """`token_ends` with the run's tokenizer, loaded when first needed."""

    def __init__(self, checkpoint: str | None, *, skip_special_tokens: bool) -> None:
        self.checkpoint = checkpoint
        self.skip_special_tokens = skip_special_tokens
        self._tokenizer: Any = None

    def place(self, response: str, response_ids: Sequence[int], char_ends: Sequence[int]) -> np.ndarray:
        return token_ends(self._decode, response_ids, response, char_ends)

    def _decode(self, ids: Sequence[int]) -> str:
        if self._tokenizer is None:
            if self.checkpoint is None:
                raise ValueError("step_rewards: placing steps on tokens needs the run's tokenizer (--hf-checkpoint), "
                                 "and this run names none")
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.checkpoint)
        return self._tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
