"""What the torch engine reads off a Hugging Face model before it serves it: whether its attention is one the engine
batches, the token ids that end a sample, its context length, and how its folder loads."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer, PreTrainedTokenizerBase

from engines.checkpoint_config import checkpoint_block, is_fp8, read_config
from engines.inference.fp8_linear import load_fp8_checkpoint
from engines.vision.images import DEFAULT_LIMITS, ImageLimits
from engines.vision.processor import VisionProcessor


def check_supported(model: nn.Module) -> None:
    """Only full-attention decoders: sliding-window and linear-attention layers need caches we do not batch."""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no .config; the torch engine needs a Hugging Face model")
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise ValueError(
            f"{type(model).__name__}: layer types {sorted(layer_types)} are not supported; the torch engine "
            "batches full-attention KV caches only"
        )


def eos_token_ids(model: nn.Module, tokenizer: PreTrainedTokenizerBase | None) -> frozenset[int]:
    """The ids that end a sample unless ignore_eos: the model's generation config, as `generate()` uses."""
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            return frozenset([eos] if isinstance(eos, int) else eos)
    return frozenset()


def context_length(config: object) -> int | None:
    """The longest sequence a model config was built for (a vision-language model's is its language model's)."""
    for source in (config, getattr(config, "text_config", None)):
        length = getattr(source, "max_position_embeddings", None)
        if length:
            return int(length)
    return None


def load_model_folder(path: Path, *, dtype: torch.dtype, device: str | torch.device,
                      image_limits: ImageLimits = DEFAULT_LIMITS,
                      ) -> tuple[nn.Module, PreTrainedTokenizerBase, VisionProcessor | None]:
    """A local HF folder's model, tokenizer and, for a vision-language model, its image side. A VLM loads through
    the image-text class (`AutoModelForCausalLM` refuses their configs); its forward takes token ids as a causal LM's
    does, plus the images' pixels on the prefill. An FP8 checkpoint's projections are served in FP8 (`fp8_linear`)."""
    vision = VisionProcessor.from_model_folder(path, image_limits)
    loader = AutoModelForImageTextToText if vision is not None else AutoModelForCausalLM
    config = read_config(path)  # an FP8 checkpoint is served as SGLang serves it; other kinds transformers loads
    block = checkpoint_block(config, str(path)) if is_fp8(config) else None
    model = loader.from_pretrained(path, dtype=dtype) if block is None else load_fp8_checkpoint(path, loader, dtype,
                                                                                                 block)
    model = model.to(device)
    return model, AutoTokenizer.from_pretrained(path), vision
