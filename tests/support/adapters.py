"""Random LoRA adapters for a tiny model, under the wire names (`engines.training.lora`): what the multi-adapter
tests serve. B is nonzero (a fresh PEFT adapter's is zero), so each adapter changes what the model computes."""

from __future__ import annotations

import torch
from torch import Tensor, nn

TARGETS = ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")


def random_adapter(model: nn.Module, rank: int, seed: int, scale: float = 0.1) -> list[tuple[str, Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    tensors = []
    for layer in range(model.config.num_hidden_layers):
        for target in TARGETS:
            module = f"model.layers.{layer}.{target}"
            linear = model.get_submodule(module)
            tensors.append((f"{module}.lora_A.weight", torch.randn(rank, linear.in_features, generator=generator)))
            tensors.append((f"{module}.lora_B.weight",
                            scale * torch.randn(linear.out_features, rank, generator=generator)))
    return tensors


def merge_into(model: nn.Module, adapter: list[tuple[str, Tensor]], scaling: float) -> nn.Module:
    """`model` with the adapter folded into its weights, W0 + scaling * B @ A (in place; returns it)."""
    factors = dict(adapter)
    with torch.no_grad():
        for name, lora_a in factors.items():
            if name.endswith(".lora_A.weight"):
                module = name.removesuffix(".lora_A.weight")
                model.get_submodule(module).weight.add_(factors[f"{module}.lora_B.weight"] @ lora_a, alpha=scaling)
    return model
