"""A torch engine that serves FP8 weights (`--rollout-fp8`): its decoder projections become `Fp8Linear` layers.

An `Fp8Linear` holds what an FP8 push loads into (`engines.weights.fp8`): `weight` in float8_e4m3fn and
`weight_scale_inv` per tile, under the names the learner pushes and SGLang serves, so a push is copied in place and
the weight check fingerprints the FP8 bytes themselves. It computes as SGLang's W8A8 block kernels do: the input
quantised through FP8 per token and group, times the block-scaled weight, by one of two kernels (`Fp8Linear.use`):

- `scaled_mm`: torch's scaled matmul reads the FP8 bytes and both sets of scales (`fp8_matmul.py`). The layer keeps
  nothing else, so an FP8 engine's projections cost their FP8 bytes and scales only. What CUDA engines use.
- `dequantised`: the layer keeps its weight dequantised in the model's dtype (`served`, derived, never pushed) and
  refreshes it after every load that changed the FP8 bytes or scales (`refresh_changed`, which the engine calls
  between steps), then multiplies the rounded inputs by it. That copy costs the unquantised weight's memory again,
  and on a CPU it is several times faster than the scaled matmul (docs/fp8.md), so a CPU engine uses it by default.

A one-policy LoRA run merges its adapter into `served` (`merge_target`), on top of the dequantised FP8 base, so a
layer an adapter merges into computes with the dense copy whatever its kernel: an SGLang server likewise applies a
LoRA adapter in bfloat16 over its FP8 base. Named adapters (`multi_lora.py`) add their product to a layer's output
with either kernel.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engines.inference import fp8_matmul
from engines.weights import fp8

logger = logging.getLogger(__name__)


class RoundedInputs:
    """The last input a model's FP8 layers quantised, and its quantisation (FP8 values and scales, or the values
    rounded back, by `kind`): q, k and v (and gate and up) take the same tensor, one call after the other, so it is
    quantised once for them. Held strongly, so its identity cannot pass to a new tensor meanwhile. (Inference-mode
    tensors keep no version counter to tell an in-place write by; the decoder layers write none into the input of
    their projections.)"""

    def __init__(self) -> None:
        self._last: dict[str, tuple[Tensor, int, Any]] = {}

    def of(self, inputs: Tensor, block: int) -> Tensor:
        """`inputs` rounded through FP8, in their dtype (`fp8.fake_quantise_activations`)."""
        return self._cached("rounded", inputs, block)

    def quantised(self, inputs: Tensor, block: int) -> tuple[Tensor, Tensor]:
        """`inputs` as FP8 values and scales (`fp8.quantise_activations`)."""
        return self._cached("quantised", inputs, block)

    def _cached(self, kind: str, inputs: Tensor, block: int) -> Any:
        last = self._last.get(kind)
        if last is not None and last[0] is inputs and last[1] == block:
            return last[2]
        compute = fp8.fake_quantise_activations if kind == "rounded" else fp8.quantise_activations
        result = compute(inputs, block)
        self._last = {kind: (inputs, block, result)}  # one input at a time: the other kind's is stale now
        return result


class Fp8Linear(nn.Module):
    """A linear layer whose weight is served in FP8 with per-tile scales, computing in `dtype` (the model's) with
    `kernel` ('scaled_mm' or 'dequantised', `use`)."""

    def __init__(self, linear: nn.Linear, block: int = fp8.BLOCK, inputs: RoundedInputs | None = None,
                 kernel: str = "dequantised") -> None:
        super().__init__()
        self.block = block
        self._inputs = inputs or RoundedInputs()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = linear.weight.dtype
        values, scales = fp8.quantise(linear.weight, block)
        self.weight = nn.Parameter(values, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scales.to(linear.weight.device), requires_grad=False)
        self.bias = linear.bias
        self.register_buffer("served", None, persistent=False)
        self.recipe: fp8_matmul.Recipe | None = None  # the scaled matmul's, None: the dequantised copy's
        self._dense = False  # an adapter is merged into `served`: it stays, whatever the kernel
        self._derived_from = self._versions()
        self.use(kernel)

    def use(self, kernel: str) -> str:
        """Compute with `kernel` from now on, on the device the layer is on: 'scaled_mm' drops the dequantised copy,
        unless no recipe fits the layer's shape there (`fp8_matmul.recipe_for`) or an adapter is merged into it;
        'dequantised' derives it. What the layer computes with now."""
        if kernel not in ("scaled_mm", "dequantised"):
            raise ValueError(f"Fp8Linear kernel must be 'scaled_mm' or 'dequantised', got {kernel!r}")
        recipe = None
        if kernel == "scaled_mm" and not self._dense:
            recipe = fp8_matmul.recipe_for(self.weight.device, self.out_features, self.in_features, self.block)
        self.recipe = recipe
        if recipe is not None:
            self.served = None
        elif self.served is None:
            self.served = fp8.dequantise(self.weight, self.weight_scale_inv, self.dtype, self.block)
            self._derived_from = self._versions()
        return "dequantised" if recipe is None else "scaled_mm"

    def dense(self) -> Tensor:
        """The dequantised weight this layer computes with from now on, for an adapter to merge into."""
        self._dense = True
        self.use("dequantised")
        assert self.served is not None
        return self.served

    def _versions(self) -> tuple[int, int]:
        # Every in-place write bumps a tensor's version counter, whichever load path made it (a full copy, a
        # delta written in place, a disk read).
        return self.weight._version, self.weight_scale_inv._version

    def refresh(self) -> bool:
        """Re-derive `served`, where the layer keeps one, in place (a CUDA graph that reads it stays valid) if the FP8
        bytes or scales were written since; True if they were."""
        versions = self._versions()
        if versions == self._derived_from:
            return False
        if self.served is not None:
            with torch.no_grad():
                self.served.copy_(fp8.dequantise(self.weight, self.weight_scale_inv, self.served.dtype, self.block))
        self._derived_from = self._versions()
        return True

    def forward(self, inputs: Tensor) -> Tensor:
        if self.recipe is None:
            return F.linear(self._inputs.of(inputs, self.block), self.served, self.bias)
        values, scales = self._inputs.quantised(inputs, self.block)
        out = fp8_matmul.scaled_linear(values, scales, self.weight, self.weight_scale_inv, self.block, self.recipe)
        if self.bias is not None:
            out.add_(self.bias)
        return out.to(inputs.dtype).view(*inputs.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kernel = "dequantised" if self.recipe is None else f"scaled_mm {self.recipe}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, fp8 blocks of {self.block}, "
                f"{kernel}")


def serve_fp8(model: nn.Module, block: int = fp8.BLOCK, kernel: str = "auto") -> list[str]:
    """Replace each decoder projection (`fp8.quantised`) of `model` by an Fp8Linear of its current weight, in
    place, computing with `kernel` ('auto': the scaled matmul on CUDA, the dequantised copy on a CPU; `fp8_matmul.
    resolve`) on the device the model is on now; the names of the FP8 weights. Refuses a model with none (an
    architecture these names do not cover). A model whose projections are served in FP8 already keeps its layers and
    takes `kernel`."""
    chosen = fp8_matmul.resolve(kernel, next(model.parameters()).device)
    replaced, inputs = [], RoundedInputs()
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and fp8.quantised(f"{name}.weight", module.weight.shape):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, Fp8Linear(module, block, inputs, chosen))
            replaced.append(f"{name}.weight")
    layers = {f"{name}.weight": module for name, module in model.named_modules() if isinstance(module, Fp8Linear)}
    if not layers:
        raise ValueError(f"FP8 rollout: {type(model).__name__} has no decoder projection this engine can serve in "
                         "FP8 (layers.N.self_attn/mlp.*_proj linear layers); serve it unquantised")
    blocks = {layer.block for layer in layers.values()}
    if not replaced and blocks != {block}:  # loaded from an FP8 checkpoint (`load_fp8_checkpoint`)
        raise ValueError(f"FP8 rollout: the model is served in FP8 tiles of {sorted(blocks)}, the pushes come in "
                         f"tiles of {block}")
    kernels = [layer.use(chosen) for layer in layers.values()]
    logger.info("serving %d projections in FP8 (blocks of %d): %d by the scaled matmul, %d by a dequantised copy",
                len(layers), block, kernels.count("scaled_mm"), kernels.count("dequantised"))
    return replaced or list(layers)


def refresh_changed(model: nn.Module) -> int:
    """After a load: re-derive each Fp8Linear whose FP8 weight or scales changed; how many did."""
    return sum(module.refresh() for module in model.modules() if isinstance(module, Fp8Linear))


def merge_target(model: nn.Module, parameters: Mapping[str, Tensor]) -> Callable[[str], Tensor]:
    """The tensor a LoRA merge folds its adapter into, by weight name: an FP8 layer's dequantised weight (made when
    an adapter first merges into it: `Fp8Linear.dense`), never its FP8 bytes; any other weight itself."""
    layers = {f"{name}.weight": module for name, module in model.named_modules() if isinstance(module, Fp8Linear)}

    def target(name: str) -> Tensor:
        layer = layers.get(name)
        return parameters[name] if layer is None else layer.dense()

    return target


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
