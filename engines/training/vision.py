"""The torch trainer's vision-language side: loading a VLM folder, its vision tower frozen or trained, the 3-D rotary
positions of a packed row, and which weights the engines need.

A Qwen-VL model is its language model plus a vision tower whose features replace the image tokens' embeddings.
The trainer runs it as it runs a text model (one packed row per micro-batch, log-probs of the response tokens); what
differs is confined here:

- Loading. transformers' causal-LM class refuses a VLM config, so a folder with a vision tower loads as
  `AutoModelForImageTextToText`. The language model takes the trainer's packed attention; the vision tower keeps
  `sdpa`, since it attends within each image (its own cu_seqlens), never causally across a packed row.
- Positions. A packed row's text positions restart per sample, which is how the attention finds the samples. The
  rotary embedding reads 3-D positions (time, height, width) instead: each sample's own, from the model's
  `get_rope_index`, concatenated in row order. The model takes both as one [4, 1, T] tensor (text first), the layout
  transformers' Qwen-VL forward reads for packed rows.
- Sharing a prompt across a group's samples (`share_prompts`) is off for a batch with images: two prompts with
  equal tokens may hold different pixels (images of one size expand to the same placeholders), so equal tokens no
  longer mean an equal prefix, and the shared preamble could cover image tokens of different images.
- Training. The vision tower is frozen unless `TorchTrainerConfig.freeze_vision_tower` is False (verl's
  `freeze_vision_tower`); LoRA adapts the language model's linear layers only. The engines are pushed what changes:
  the language model's weights, and the tower's only when it trains.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from engines.checkpoint_config import is_vision_language
from engines.training.base import TrainSample
from engines.training.micro_batches import PackedInputs
from engines.vision.processor import rope_positions

VISION_ATTENTION = "sdpa"  # the tower's attention: per image, bidirectional (see the module docstring)
# The tower's module in the Qwen-VL families (transformers 5: `model.visual`; under PEFT with its prefix)
_TOWER = re.compile(r"(^|\.)visual(\.|$)")


def is_vision_folder(path: str | Path) -> bool:
    """The model folder holds a vision-language model (its config has a vision tower)."""
    return is_vision_language(json.loads((Path(path) / "config.json").read_text()))


def from_pretrained(path: str | Path, attn_implementation: str) -> nn.Module:
    """The folder's model in float32: a causal LM, or a VLM with the language model on `attn_implementation`."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if not is_vision_folder(path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn_implementation)
    return AutoModelForImageTextToText.from_pretrained(
        path, dtype=torch.float32,
        attn_implementation={"text_config": attn_implementation, "vision_config": VISION_ATTENTION})


def check_supported(model: nn.Module, config: Any) -> None:
    """What the trainer cannot do with a vision-language model, refused before the first step (`config`: a
    TorchTrainerConfig)."""
    if not is_vision_model(model):
        return
    if config.context_parallel_size > 1:
        raise ValueError(f"context_parallel_size {config.context_parallel_size}: a vision-language model's rows are "
                         "not split across ranks (their images and 3-D positions would have to be); use 1")
    if config.critic is not None:
        raise ValueError("a critic beside a vision-language policy: the value model's rows do not carry the images "
                         "yet, so its values would not see them; use an advantage estimator without a critic (grpo)")
    if config.lora is not None and not config.freeze_vision_tower:
        raise ValueError("freeze_vision_tower=False with LoRA: LoRA adapts the language model only, and a run pushes "
                         "either an adapter or full weights; train the tower without LoRA, or keep it frozen")


def is_vision_model(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    return config is not None and getattr(config, "vision_config", None) is not None


def text_config(config: Any) -> Any:
    """The language model's config (vocab_size, hidden_size, num_hidden_layers): a VLM's nested one, else itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def is_tower_weight(name: str) -> bool:
    return _TOWER.search(name) is not None


def freeze_tower(model: nn.Module, *, freeze: bool) -> None:
    """No gradient (so no optimizer state) for the vision tower's weights when `freeze`."""
    if not is_vision_model(model):
        return
    tower = [parameter for name, parameter in model.named_parameters() if is_tower_weight(name)]
    if not tower:
        raise ValueError(f"{type(model).__name__}: no vision tower weights found (expected a `visual` module)")
    for parameter in tower:
        parameter.requires_grad_(not freeze)


def lora_exclusions(model: nn.Module) -> str | None:
    """The modules LoRA must leave alone (PEFT's `exclude_modules`, a regex): the vision tower of a VLM."""
    return r"(.*\.)?visual(\..*)?" if is_vision_model(model) else None


def pushed(named: Iterable[tuple[str, Tensor]], *, tower_trains: bool) -> Iterator[tuple[str, Tensor]]:
    """The weights the engines need: all but a frozen vision tower's (the engines load it from the folder)."""
    for name, tensor in named:
        if tower_trains or not is_tower_weight(name):
            yield name, tensor


def sharing_allowed(samples: Sequence[TrainSample]) -> bool:
    """`share_prompts` for a batch: not when any sample has images (module docstring)."""
    return not any(sample.vision is not None and sample.vision.images for sample in samples)


def with_rope_positions(model: nn.Module, inputs: PackedInputs, samples: Sequence[TrainSample]) -> PackedInputs:
    """The row with each sample's 3-D rotary positions, when it has images (then unshared: each sample is one run of
    the row, in order). A row of text alone keeps none: its rotary positions are its text positions on all three
    axes (`micro_batches.forward_packed`), shared prompts included."""
    if not is_vision_model(model) or inputs.vision is None:
        return inputs
    image_token = int(model.config.image_token_id)
    owner = model.get_base_model() if hasattr(model, "get_base_model") else model  # under PEFT, the VLM
    parts = []
    for sample in samples:
        vision = sample.vision if sample.vision is not None and sample.vision.images else None
        positions, _ = rope_positions(owner, sample.tokens, vision, image_token)
        parts.append(positions)
    positions = torch.cat(parts, dim=1).unsqueeze(1).to(inputs.position_ids.device)
    if positions.shape[-1] != inputs.position_ids.shape[-1]:
        raise ValueError(f"rotary positions of {positions.shape[-1]} tokens for a row of "
                         f"{inputs.position_ids.shape[-1]}: a row with images is packed without shared prompts")
    return replace(inputs, rope_positions=positions)
