"""A vision-language model's image side: its image processor, its placeholder token and how many of them an image
takes, and the multimodal rotary positions of a prompt that holds images.

The Qwen-VL families put one `<|image_pad|>` in the chat template per image and expand it to one token per merged
patch (grid t*h*w / merge^2); the vision tower's features replace those tokens' embeddings, and their rotary
positions run over (time, height, width) instead of one index. Our tokens are the expanded ones everywhere (the
sample's `tokens`, the engine's prompt, the learner's row), so a prompt's length is what the model attends to.

transformers' processor class for these families (`Qwen2_5_VLProcessor`) builds a video processor that needs
torchvision, whose wheels on the package index are CUDA builds that do not load beside the CPU torch. So we load the
family's image processor (`AutoImageProcessor`, PIL backend: the same pixels on every machine) and expand the
placeholders ourselves: the only thing the processor class adds for images.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engines.checkpoint_config import is_vision_language
from engines.vision.images import DEFAULT_LIMITS, ImageLimits, decode_image

# Model types whose processor and positions this module knows: the Qwen-VL families slime, AReaL and verl train.
QWEN_VL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


@dataclass(frozen=True)
class VisionInputs:
    """What a forward needs for a prompt's images, in their order in the prompt."""

    pixel_values: torch.Tensor  # [patches of every image, channels * temporal * patch^2]
    grid_thw: torch.Tensor  # [images, 3] int64: each image's patch grid (time, height, width)
    tokens_per_image: tuple[int, ...]  # placeholder tokens each image takes in the prompt

    @property
    def images(self) -> int:
        return len(self.tokens_per_image)

    @staticmethod
    def join(parts: Sequence[VisionInputs]) -> VisionInputs | None:
        """Several prompts' images as one forward's (a batch's or a packed row's), in prompt order."""
        parts = [part for part in parts if part.images]
        if not parts:
            return None
        return VisionInputs(torch.cat([part.pixel_values for part in parts]),
                            torch.cat([part.grid_thw for part in parts]),
                            tuple(count for part in parts for count in part.tokens_per_image))


class VisionProcessor:
    """The image side of one vision-language model folder."""

    def __init__(self, image_processor: Any, *, model_type: str, image_token_id: int, vision_start_token_id: int,
                 limits: ImageLimits = DEFAULT_LIMITS) -> None:
        self.image_processor = image_processor
        self.model_type = model_type
        self.image_token_id = image_token_id
        self.vision_start_token_id = vision_start_token_id
        self.merge_size = int(image_processor.merge_size)
        self.limits = limits

    @classmethod
    def from_model_folder(cls, path: str | Path, limits: ImageLimits = DEFAULT_LIMITS) -> VisionProcessor | None:
        """The folder's image side, or None for a text-only model. A vision-language family we cannot run is
        refused naming the ones we can."""
        config = json.loads((Path(path) / "config.json").read_text())
        if not is_vision_language(config):
            return None
        model_type = config.get("model_type")
        if model_type not in QWEN_VL_TYPES:
            raise ValueError(f"{path}: vision-language model type {model_type!r} is not supported; images work with "
                             f"{', '.join(QWEN_VL_TYPES)}")
        from transformers import AutoImageProcessor

        image_processor = AutoImageProcessor.from_pretrained(path, backend="pil")
        return cls(image_processor, model_type=model_type, image_token_id=int(config["image_token_id"]),
                   vision_start_token_id=int(config["vision_start_token_id"]), limits=limits)

    def encode(self, images: Sequence[bytes], *, where: str) -> VisionInputs:
        """Decode and process a prompt's images; `where` names the prompt in errors ("image 2 of <where>")."""
        decoded = [decode_image(data, where=f"image {index} of {where}", limits=self.limits)
                   for index, data in enumerate(images)]
        if not decoded:
            return VisionInputs(torch.zeros(0, 0), torch.zeros(0, 3, dtype=torch.int64), ())
        processed = self.image_processor(images=decoded, return_tensors="pt")
        grid = processed["image_grid_thw"].to(torch.int64)
        counts = tuple(int(cells) // self.merge_size**2 for cells in grid.prod(dim=-1).tolist())
        return VisionInputs(processed["pixel_values"], grid, counts)

    def expand_placeholders(self, token_ids: Sequence[int], inputs: VisionInputs, *, where: str) -> list[int]:
        """The prompt with each image's single placeholder token repeated to the tokens the image takes. A prompt
        whose placeholders do not match its images in number is refused: the features would land on the wrong
        tokens (or on none)."""
        placeholders = sum(1 for token in token_ids if token == self.image_token_id)
        if placeholders != inputs.images:
            raise ValueError(f"{where}: the prompt has {placeholders} image placeholder(s) for {inputs.images} "
                             "image(s); each image needs one image item in the messages")
        counts = iter(inputs.tokens_per_image)
        expanded: list[int] = []
        for token in token_ids:
            expanded.extend([token] * next(counts) if token == self.image_token_id else [token])
        return expanded

    def check_expanded(self, token_ids: Sequence[int], inputs: VisionInputs, *, where: str) -> None:
        """Refuse expanded tokens whose image tokens are not exactly the images' (a prompt tokenized for another
        image size, or images lost on the way)."""
        found = sum(1 for token in token_ids if token == self.image_token_id)
        wanted = sum(inputs.tokens_per_image)
        if found != wanted:
            raise ValueError(f"{where}: the tokens hold {found} image token(s) where its {inputs.images} image(s) "
                             f"take {wanted}")


def rope_positions(model: torch.nn.Module, token_ids: torch.Tensor, inputs: VisionInputs | None,
                   image_token_id: int) -> tuple[torch.Tensor, int]:
    """Rotary positions [3, L] of one sequence (time, height, width; equal for text tokens) and the position of the
    token after it. Text-only sequences get 0..L-1 on all three. The model's own `get_rope_index` computes them, so
    each family's layout (Qwen2.5-VL's per-second time steps, Qwen3-VL's) is the model's."""
    length = token_ids.shape[-1]
    if inputs is None or inputs.images == 0:
        positions = torch.arange(length, device=token_ids.device).expand(3, length)
        return positions, length
    ids = token_ids.view(1, -1)
    token_types = (ids == image_token_id).to(torch.int32)
    positions, _ = _language_model_owner(model).get_rope_index(
        ids, mm_token_type_ids=token_types, image_grid_thw=inputs.grid_thw.to(token_ids.device))
    positions = positions[:, 0, :]
    return positions, int(positions.max()) + 1


def _language_model_owner(model: torch.nn.Module) -> torch.nn.Module:
    """The module holding `get_rope_index`: the VLM's inner model (`model.model`), or the model itself."""
    inner = getattr(model, "model", model)
    if hasattr(inner, "get_rope_index"):
        return inner
    if hasattr(model, "get_rope_index"):
        return model
    raise TypeError(f"{type(model).__name__} has no get_rope_index: not a Qwen-VL model")
