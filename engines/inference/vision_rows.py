"""A prompt with images as the torch engine runs it: its images processed once per request (the request's n samples
share them) and the rotary positions of its tokens.

A Qwen-VL prompt's image tokens take fewer rotary positions than tokens (an image's grid runs over time, height and
width), so a row's next position is not its token count: the prefill hands each row's next position to the decode
steps, which feed text tokens (one index, the same on all three axes). A row prefilled again (its cache was dropped
for new weights) continues from the prompt's next position. Rows with images bypass the prefix cache: their tokens
(one placeholder id per image token) do not say which image they show, so a cached copy could be another image's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from engines.vision.processor import VisionInputs, VisionProcessor, rope_positions


def placeholder_tokens(model: nn.Module) -> list[int]:
    """The ids a vision-language model's forward takes for image (and video) slots. The engine never samples them:
    a generated one would be taken for an image slot by every later forward over the sequence (a prefill after a
    weight update, the learner's), which then finds more slots than images and fails. A trained VLM gives them
    next to no probability; a tiny random one about 1/vocabulary, so its reported log-probs (under the distribution
    without them, as sampled) sit that much above the learner's."""
    config = model.config
    return [int(token) for token in (getattr(config, "image_token_id", None), getattr(config, "video_token_id", None))
            if token is not None]


@dataclass(frozen=True, eq=False)
class PromptVision:
    """One request's processed images and its prompt's rotary positions."""

    inputs: VisionInputs
    positions: torch.Tensor  # [3, prompt tokens] int64
    next_position: int  # the rotary position of the first token after the prompt

    def positions_of(self, length: int) -> torch.Tensor:
        """Positions [3, length] of the prompt followed by `length - prompt` generated tokens."""
        prompt = self.positions.shape[1]
        if length <= prompt:
            return self.positions[:, :length]
        tail = torch.arange(self.next_position, self.next_position + length - prompt).expand(3, -1)
        return torch.cat([self.positions, tail], dim=1)

    def next_position_after(self, length: int) -> int:
        """The position of the token after `length` tokens of prompt + output (length >= the prompt's)."""
        return self.next_position + length - self.positions.shape[1]


def prompt_vision(processor: VisionProcessor | None, model: nn.Module, request_id: str, input_ids: list[int],
                  images: Sequence[bytes]) -> PromptVision | None:
    """The request's images processed and checked against its tokens; None for a request without images. Refused
    (ValueError naming the request) on a text-only model, or when the tokens' image tokens are not the images'."""
    if not images:
        if processor is not None and processor.image_token_id in input_ids:
            raise ValueError(f"request {request_id!r}: its tokens hold image tokens but it carries no images")
        return None
    if processor is None:
        raise ValueError(f"request {request_id!r}: {len(images)} image(s) sent to a text-only model "
                         f"({type(model).__name__}); images need a vision-language model")
    where = f"request {request_id!r}"
    inputs = processor.encode(images, where=where)
    processor.check_expanded(input_ids, inputs, where=where)
    positions, next_position = rope_positions(model, torch.tensor(input_ids), inputs, processor.image_token_id)
    return PromptVision(inputs, positions.cpu(), next_position)


@dataclass(frozen=True)
class PrefillVision:
    """What a prefill forward of some rows with images needs beyond their tokens: every image in row order, and the
    rows' rotary positions laid out like their left-padded tokens."""

    inputs: VisionInputs
    positions: torch.Tensor  # [3, rows, width]
    next_positions: torch.Tensor  # [rows]

    @classmethod
    def build(cls, rows: Sequence[PromptVision | None], lengths: Sequence[int], width: int,
              device: torch.device) -> PrefillVision | None:
        """For left-padded rows of `lengths` tokens in a [rows, width] input; None when no row has images."""
        joined = VisionInputs.join([vision.inputs for vision in rows if vision is not None])
        if joined is None:
            return None
        positions = torch.zeros((3, len(rows), width), dtype=torch.int64)
        next_positions = []
        for row, (vision, length) in enumerate(zip(rows, lengths, strict=True)):
            if vision is None:
                positions[:, row, width - length :] = torch.arange(length)
                next_positions.append(length)
            else:
                positions[:, row, width - length :] = vision.positions_of(length)
                next_positions.append(vision.next_position_after(length))
        return cls(joined, positions.to(device), torch.tensor(next_positions, dtype=torch.int64, device=device))

    def forward_inputs(self, model: nn.Module) -> dict[str, torch.Tensor]:
        parameter = next(model.parameters())
        return {"pixel_values": self.inputs.pixel_values.to(parameter.device, parameter.dtype),
                "image_grid_thw": self.inputs.grid_thw.to(parameter.device), "position_ids": self.positions}
