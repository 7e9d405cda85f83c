"""How the torch trainers load a Hugging Face model: deterministic (no dropout), without a KV cache, on its device.

Dropout is switched off at load because RL needs the learner's log-probs to be the behaviour policy's log-probs up
to off-policyness; random masks would add noise to every importance ratio.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from engines.training import vision
from engines.training.attention import register_packed_attention

_DROPOUT_CONFIG_FIELDS = ("attention_dropout", "hidden_dropout", "dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop")


def load_model(path: Path, device: torch.device, attn_implementation: str) -> nn.Module:
    register_packed_attention()
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"model path {path}: no config.json (expected a Hugging Face model folder)")
    model = vision.from_pretrained(path, attn_implementation)
    for config in {id(c): c for c in (model.config, vision.text_config(model.config))}.values():
        for field_name in _DROPOUT_CONFIG_FIELDS:
            if isinstance(getattr(config, field_name, None), float):
                setattr(config, field_name, 0.0)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    model.config.use_cache = False
    return model.to(device)


def enable_activation_checkpointing(model: nn.Module) -> None:
    """transformers 5 renamed gradient checkpointing; 4.x only has the old name."""
    options = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
