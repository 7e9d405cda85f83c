"""A torch engine that serves FP8 weights (`--rollout-fp8`): its decoder projections become `Fp8Linear` layers.

An `Fp8Linear` holds what an FP8 push loads into (`engines.weights.fp8`): `weight` in float8_e4m3fn and
`weight_scale_inv` per tile, under the names the learner pushes and SGLang serves, so a push is copied in place and
the weight check fingerprints the FP8 bytes themselves. It computes as SGLang's W8A8 block kernels do: the input
rounded through FP8 per token and group, times the dequantised weight.

On a CPU there is no FP8 matmul, so each layer keeps its weight dequantised in the model's dtype (`served`, derived,
never pushed) and refreshes it after every load that changed the FP8 bytes or scales (`refresh_changed`, which the
engine calls between steps). That copy costs the memory of the unquantised weight again; a GPU kernel that reads the
FP8 bytes directly (`torch._scaled_mm`) would not need it, and is not built yet.

A one-policy LoRA run merges its adapter into `served` (`merge_targets`), on top of the dequantised FP8 base:
an SGLang server likewise applies a LoRA adapter in bfloat16 over its FP8 base.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engines.weights import fp8

logger = logging.getLogger(__name__)


class RoundedInputs:
    """The last input a model's FP8 layers rounded through FP8, and its rounding: q, k and v (and gate and up) take the
    same tensor, one call after the other, so it is rounded once for them. Held strongly, so its identity cannot
    pass to a new tensor meanwhile. (Inference-mode tensors keep no version counter to tell an in-place write by;
    the decoder layers write none into the input of their projections.)"""

    def __init__(self) -> None:
        self._last: tuple[Tensor, int, Tensor] | None = None

    def of(self, inputs: Tensor, block: int) -> Tensor:
        last = self._last
        if last is not None and last[0] is inputs and last[1] == block:
            return last[2]
        rounded = fp8.fake_quantise_activations(inputs, block)
        self._last = (inputs, block, rounded)
        return rounded


class Fp8Linear(nn.Module):
    """A linear layer whose weight is served in FP8 with per-tile scales, computing in `dtype` (the model's)."""

    def __init__(self, linear: nn.Linear, block: int = fp8.BLOCK, inputs: RoundedInputs | None = None) -> None:
        super().__init__()
        self.block = block
        self._inputs = inputs or RoundedInputs()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        values, scales = fp8.quantise(linear.weight, block)
        self.weight = nn.Parameter(values, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scales.to(linear.weight.device), requires_grad=False)
        self.bias = linear.bias
        self.register_buffer("served", fp8.dequantise(values, self.weight_scale_inv, linear.weight.dtype, block),
                             persistent=False)
        self._derived_from = self._versions()

    def _versions(self) -> tuple[int, int]:
        # Every in-place write bumps a tensor's version counter, whichever load path made it (a full copy, a
        # delta written in place, a disk read).
        return self.weight._version, self.weight_scale_inv._version

    def refresh(self) -> bool:
        """Re-derive `served` in place (a CUDA graph that reads it stays valid) if the FP8 bytes or scales were
        written since; True if they were."""
        versions = self._versions()
        if versions == self._derived_from:
            return False
        with torch.no_grad():
            self.served.copy_(fp8.dequantise(self.weight, self.weight_scale_inv, self.served.dtype, self.block))
        self._derived_from = self._versions()
        return True

    def forward(self, inputs: Tensor) -> Tensor:
        return F.linear(self._inputs.of(inputs, self.block), self.served, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 blocks of {self.block}"


def serve_fp8(model: nn.Module, block: int = fp8.BLOCK) -> list[str]:
    """Replace each decoder projection (`fp8.quantised`) of `model` by an Fp8Linear of its current weight, in
    place; the names of the FP8 weights. Refuses a model with none (an architecture these names do not cover). A
    model whose projections are served in FP8 already is left as it is."""
    replaced, inputs = [], RoundedInputs()
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and fp8.quantised(f"{name}.weight", module.weight.shape):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, Fp8Linear(module, block, inputs))
            replaced.append(f"{name}.weight")
    served = {f"{name}.weight": module.block for name, module in model.named_modules()
              if isinstance(module, Fp8Linear)}
    if not replaced and served:  # loaded from an FP8 checkpoint (`load_fp8_checkpoint`): served already
        if set(served.values()) != {block}:
            raise ValueError(f"FP8 rollout: the model is served in FP8 tiles of {sorted(set(served.values()))}, "
                             f"the pushes come in tiles of {block}")
        return list(served)
    if not replaced:
        raise ValueError(f"FP8 rollout: {type(model).__name__} has no decoder projection this engine can serve in "
                         "FP8 (layers.N.self_attn/mlp.*_proj linear layers); serve it unquantised")
    logger.info("serving %d projections in FP8 (blocks of %d)", len(replaced), block)
    return replaced


def refresh_changed(model: nn.Module) -> int:
    """After a load: re-derive each Fp8Linear whose FP8 weight or scales changed; how many did."""
    return sum(module.refresh() for module in model.modules() if isinstance(module, Fp8Linear))


def merge_targets(model: nn.Module, parameters: dict[str, Tensor]) -> dict[str, Tensor]:
    """`parameters` with each FP8 layer's `<module>.weight` swapped for what it computes with, so a LoRA merge
    folds its adapter into that (its base: the dequantised FP8 weight), never into the FP8 bytes."""
    targets = dict(parameters)
    for name, module in model.named_modules():
        if isinstance(module, Fp8Linear):
            targets[f"{name}.weight"] = module.served
    return targets


def load_fp8_checkpoint(folder: Path, loader: Any, dtype: torch.dtype, block: int) -> nn.Module:
    """The model of an FP8 checkpoint (`engines.fp8_checkpoint`), its projections served with the FP8 bytes and
    scales stored there, not quantised again, as SGLang loads them. transformers cannot load such a folder without a
    GPU, so the model is loaded as an unquantised one (the FP8 values cast exactly into `dtype`, the scales left
    out) and each projection then replaced and filled from the files."""
    from transformers import AutoConfig

    from engines.fp8_checkpoint import stored_tensors

    config = AutoConfig.from_pretrained(folder)
    del config.quantization_config
    model = loader.from_pretrained(folder, config=config, dtype=dtype)
    names = serve_fp8(model, block)
    stored = stored_tensors(folder, lambda key: key in names or key.removesuffix(fp8.SCALE_SUFFIX) in names)
    with torch.no_grad():
        for name in names:
            layer = model.get_submodule(name.removesuffix(".weight"))
            for parameter, key in ((layer.weight, name), (layer.weight_scale_inv, fp8.scale_name(name))):
                tensor = stored.get(key)
                if tensor is None or tensor.dtype != parameter.dtype or tensor.shape != parameter.shape:
                    found = "missing" if tensor is None else f"{tensor.dtype} {list(tensor.shape)}"
                    raise ValueError(f"{folder}: FP8 checkpoint tensor {key!r} is {found}, expected "
                                     f"{parameter.dtype} {list(parameter.shape)}")
                parameter.copy_(tensor)
    refresh_changed(model)
    return model
