"""What the torch engine reads off a Hugging Face model before it serves it: whether its attention is one the engine
batches, and the token ids that end a sample."""

from __future__ import annotations

from torch import nn
from transformers import PreTrainedTokenizerBase


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
