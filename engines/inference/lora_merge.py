"""LoRA adapters folded into an engine's weights: a LoRA run's updates are adapters, the engine serves merged.

Merging rather than running adapter layers: decoding then costs exactly what it costs for the base model, and an
update recomputes `W = W0 + scaling * B @ A` for the adapted layers only, which is a rank-r product per layer
(milliseconds), far cheaper than the bytes a full-weight push moves. The engine keeps each adapted layer's base
weight `W0` (a copy, taken the first time an adapter for it arrives) and the latest A and B, so the merge never
drifts however many versions go by, and an A that arrives in one bucket and its B in the next merge right.

The names are `engines.training.lora`'s: `<module>.lora_A.weight` and `<module>.lora_B.weight` update the
layer whose weight is `<module>.weight`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import Tensor

from engines.training.lora import WIRE_SUFFIXES

NamedTensor = tuple[str, Tensor]
MERGE_CHECK_ROWS = 8


def is_adapter(name: str) -> bool:
    return name.endswith(WIRE_SUFFIXES)


class AdapterMerger:
    """Adapters of one engine's model. `scaling` is the run's `lora_alpha / lora_rank`; None refuses adapters
    (an engine started without LoRA settings would otherwise fold them in at an unknown scale). `target`: the tensor
    an adapter merges into, by weight name, when that is not the parameter itself (an FP8 layer's dequantised
    weight, made on first use: `fp8_linear.merge_target`); the parameters give the layers' shapes."""

    def __init__(self, parameters: Mapping[str, Tensor], scaling: float | None,
                 target: Callable[[str], Tensor] | None = None) -> None:
        self._parameters = parameters
        self._target = target or parameters.__getitem__
        self._scaling = scaling
        self._bases: dict[str, Tensor] = {}  # module -> its weight before any adapter
        self._factors: dict[str, dict[str, Tensor]] = {}  # module -> {"lora_A": A, "lora_B": B}, the latest
        self._rows = torch.Generator().manual_seed(0)  # which rows `_holds_merge` checks, different each time

    def check(self, updates: Sequence[NamedTensor]) -> None:
        """Raise a ValueError naming the first adapter tensor that cannot apply; changes nothing."""
        if updates and self._scaling is None:
            raise ValueError(f"update_weights: {updates[0][0]!r} is a LoRA adapter tensor, but this engine was "
                             "started without LoRA settings (--lora-rank, --lora-alpha)")
        arriving: dict[str, dict[str, Tensor]] = {}
        for name, tensor in updates:
            module, factor = _split(name)
            weight = self._parameters.get(f"{module}.weight")
            if weight is None or weight.dim() != 2:
                raise ValueError(f"update_weights: {name!r}: the model has no linear layer {module!r}")
            if not isinstance(tensor, Tensor) or tensor.dim() != 2:
                raise ValueError(f"update_weights: {name!r} must be a matrix, got {_describe(tensor)}")
            out_features, in_features = weight.shape
            if factor == "lora_A" and tensor.shape[1] != in_features:
                raise ValueError(f"update_weights: {name!r} has shape {tuple(tensor.shape)}; the layer takes "
                                 f"{in_features} inputs")
            if factor == "lora_B" and tensor.shape[0] != out_features:
                raise ValueError(f"update_weights: {name!r} has shape {tuple(tensor.shape)}; the layer has "
                                 f"{out_features} outputs")
            arriving.setdefault(module, {})[factor] = tensor
        for module, factors in arriving.items():
            pair = {**self._factors.get(module, {}), **factors}
            if len(pair) == 2 and pair["lora_A"].shape[0] != pair["lora_B"].shape[1]:
                raise ValueError(f"update_weights: {module}: lora_A has rank {pair['lora_A'].shape[0]}, lora_B "
                                 f"rank {pair['lora_B'].shape[1]}")

    def apply(self, updates: Sequence[NamedTensor]) -> None:
        """Store the new factors and re-merge every layer they touch (call `check` first)."""
        touched: set[str] = set()
        for name, tensor in updates:
            module, factor = _split(name)
            self._factors.setdefault(module, {})[factor] = tensor.detach().clone()
            touched.add(module)
        for module in sorted(touched):
            self._merge(module)

    def rebase(self, name: str, tensor: Tensor) -> bool:
        """A full-weight update of an adapted layer's weight is its new base (the adapter stays on top).
        True if `name` was such a weight and is now merged; False leaves the update to the caller."""
        module = name.removesuffix(".weight")
        if name == module or module not in self._bases:
            return False
        self._bases[module] = tensor.detach().to(self._bases[module].dtype, copy=True)
        self._merge(module)
        return True

    def merges(self, name: str) -> bool:
        """Whether the weight `name` holds a merged adapter on top of its base."""
        return name.removesuffix(".weight") in self._bases

    def served(self, names: Iterable[str]) -> dict[str, Tensor]:
        """Each factor of `names` as this engine last merged it, left out where its layer does not hold that merge
        (the factor never arrived, or the weight was written since): what the engine fingerprints for a LoRA
        push. Each layer's merge is checked once."""
        holds: dict[str, bool] = {}
        served = {}
        for name in names:
            module, factor = _split(name)
            factors = self._factors.get(module, {})
            if module not in holds:
                holds[module] = self._holds_merge(module)
            if factor in factors and holds[module]:
                served[name] = factors[factor]
        return served

    def _holds_merge(self, module: str) -> bool:
        """Whether the layer's weight is `W0 + scaling * B @ A` of the stored factors, on MERGE_CHECK_ROWS rows
        drawn anew each time, up to the rounding of the merge itself (far below the adapter's own contribution,
        which an unmerged layer lacks entirely). Rows, not the whole layer: a whole check reads every adapted
        weight, many times the bytes of the adapter push it is checking."""
        factors = self._factors.get(module, {})
        if len(factors) < 2 or module not in self._bases:
            return False
        weight = self._target(f"{module}.weight")
        rows = torch.randperm(weight.shape[0], generator=self._rows)[:MERGE_CHECK_ROWS].to(weight.device)
        lora_b, lora_a = (factors[name].to(weight.device, weight.dtype) for name in ("lora_B", "lora_A"))
        with torch.no_grad():
            delta = torch.mm(lora_b[rows], lora_a).mul_(self._scaling)
            served = weight[rows]
            error = (served - self._bases[module][rows] - delta).abs().max()
            rounding = 2 * torch.finfo(weight.dtype).eps * served.abs().max()
            return bool(error <= 1e-3 * delta.abs().max() + rounding)

    def _merge(self, module: str) -> None:
        assert self._scaling is not None  # check() refused adapters otherwise
        weight = self._target(f"{module}.weight")
        base = self._bases.setdefault(module, weight.detach().clone())
        factors = self._factors.get(module, {})
        if len(factors) < 2:  # one factor so far: the product is still B's zeros (or A waits for its B)
            return
        lora_b, lora_a = (factors[name].to(weight.device, weight.dtype) for name in ("lora_B", "lora_A"))
        with torch.no_grad():  # one pass over the weight, no temporary of its size: W = W0 + scaling * (B @ A)
            torch.addmm(base, lora_b, lora_a, alpha=self._scaling, out=weight)


def _split(name: str) -> tuple[str, str]:
    """`model.layers.0.self_attn.q_proj.lora_A.weight` -> (`model.layers.0.self_attn.q_proj`, `lora_A`)."""
    stem = name.removesuffix(".weight")
    module, _, factor = stem.rpartition(".")
    return module, factor


def _describe(value: object) -> str:
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"
