"""Several LoRA adapters served at once, unmerged beside the base weights: each row of a batch names its own.

Merging (`lora_merge`) makes an adapter free at decode time but leaves room for exactly one. Here every adapted
Linear layer keeps, per adapter, its factors A (rank x in) and B (out x rank) in two stacks indexed by an adapter's
slot, and a forward hook adds `scaling_i * (x @ A_i^T) @ B_i^T` to each row's output. The rows are grouped by
adapter once per forward (`adapter_rows`), and each layer applies each adapter present to its rows in two matmuls:
one step serves any mix of adapters in one pass of the model, never a pass per adapter. Grouping, not gathering
each row's factors, keeps a step near the base model's cost: a gather copied B (out x rank) once per row and layer,
and a decode step of 16 rows of two rank-16 adapters on SmolLM2 took 1.58x the merged step; grouped it takes
1.18x (`python -m tools.bench.multi_lora`). A row without an adapter is left alone and gets the base model's output
bit for bit.

An adapter is loaded, replaced or removed by writing its own slot only, so the others' factors, and with the same
stack shapes their outputs, stay bit-identical. A stack's rank is the largest rank loaded into that layer (smaller
adapters are zero-padded, which adds exact zeros); a larger one reallocates the layer's stacks.

Tensor names are `engines.training.lora`'s wire names: `<module>.lora_A.weight` and `<module>.lora_B.weight`
adapt the Linear layer at `<module>`, or the FP8 layer serving it (`fp8_linear.Fp8Linear`, whichever its kernel).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from engines.inference.fp8_linear import Fp8Linear
from engines.training.lora import WIRE_SUFFIXES

NamedTensor = tuple[str, Tensor]
BASE_SLOT = 0  # the zero factors of rows served without an adapter
FACTORS = ("lora_A", "lora_B")


@dataclass
class _Layer:
    """One adapted Linear layer: its factor stacks ([slots, rank, in] and [slots, out, rank], B pre-scaled) and the
    hook that applies them."""

    linear: nn.Linear | Fp8Linear
    lora_a: Tensor
    lora_b: Tensor
    hook: torch.utils.hooks.RemovableHandle | None = None


@dataclass
class _Adapter:
    slot: int
    scaling: float
    factors: dict[str, dict[str, Tensor]] = field(default_factory=dict)  # module -> {"lora_A": A, "lora_B": B}


class MultiLora:
    """The named adapters one model serves. `max_adapters` bounds the slots (each adapted layer holds
    `max_adapters + 1` factor pairs of the largest rank); `adapter_rows` sets which adapter each row of the next
    forwards uses."""

    def __init__(self, model: nn.Module, *, max_adapters: int = 8) -> None:
        if not isinstance(max_adapters, int) or max_adapters < 1:
            raise ValueError(f"max_adapters must be an int >= 1, got {max_adapters!r}")
        self._linears = {name: module for name, module in model.named_modules()
                         if isinstance(module, (nn.Linear, Fp8Linear))}
        self._max_adapters = max_adapters
        self._adapters: dict[str, _Adapter] = {}
        self._layers: dict[str, _Layer] = {}
        # The forward running now: its row count, and the rows of each adapter slot in it (None: all base).
        self._groups: tuple[int, list[tuple[int, Tensor]]] | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._adapters)

    def __contains__(self, name: object) -> bool:
        return name in self._adapters

    def load(self, name: str, named_tensors: Sequence[NamedTensor], scaling: float) -> None:
        """Load adapter `name`, or update it in place: the given factors replace the adapter's factors of their
        layers, its other layers keep theirs. Every tensor is checked before any is written, so a bad load changes
        nothing; after it, each layer of the adapter must hold both A and B of one rank."""
        adapter = self._adapters.get(name)
        staged = self._check(name, named_tensors, scaling, adapter)
        if adapter is None:
            adapter = _Adapter(self._free_slot(), scaling)
            self._adapters[name] = adapter
        rescaled = adapter.scaling != scaling
        adapter.scaling = scaling
        for module, pair in staged.items():
            adapter.factors[module] = pair
        for module in adapter.factors if rescaled else staged:
            self._write(module, adapter.slot, adapter.factors[module], scaling)

    def remove(self, name: str) -> None:
        """Stop serving `name`: its slot is zeroed (rows still naming it would get the base) and freed."""
        adapter = self._adapters.pop(name, None)
        if adapter is None:
            raise KeyError(f"adapter {name!r} is not loaded (loaded: {sorted(self._adapters)})")
        for module in adapter.factors:
            layer = self._layers[module]
            layer.lora_a[adapter.slot].zero_()
            layer.lora_b[adapter.slot].zero_()
            if not any(module in other.factors for other in self._adapters.values()):
                assert layer.hook is not None
                layer.hook.remove()
                del self._layers[module]

    def slots(self, adapters: Sequence[str | None], device: torch.device | str) -> Tensor:
        """The slot index of each row (`None`: the base model), for `adapter_rows`."""
        slots = []
        for row, name in enumerate(adapters):
            if name is None:
                slots.append(BASE_SLOT)
            elif name in self._adapters:
                slots.append(self._adapters[name].slot)
            else:
                raise KeyError(f"row {row}: adapter {name!r} is not loaded (loaded: {sorted(self._adapters)})")
        return torch.tensor(slots, dtype=torch.long, device=device)

    def served(self, name: str, tensor_names: Iterable[str]) -> dict[str, Tensor]:
        """Each factor of `tensor_names` as adapter `name` last received it, left out where its layer's slot does not
        hold exactly what that factor writes (the factor never arrived, the slot was written since): what the
        engine fingerprints for a push to the adapter. Each layer's slot is checked once, in full (a factor pair
        is small)."""
        adapter = self._adapters.get(name)
        if adapter is None:
            return {}
        holds: dict[str, bool] = {}
        served = {}
        for tensor_name in tensor_names:
            module, factor = tensor_name.removesuffix(".weight").rpartition(".")[::2]
            pair = adapter.factors.get(module)
            if pair is None or factor not in pair:
                continue
            if module not in holds:
                holds[module] = self._slot_holds(module, adapter.slot, pair, adapter.scaling)
            if holds[module]:
                served[tensor_name] = pair[factor]
        return served

    def _slot_holds(self, module: str, slot: int, pair: dict[str, Tensor], scaling: float) -> bool:
        layer = self._layers.get(module)
        if layer is None:
            return False
        expected_a, expected_b = self._slot_values(layer, pair, scaling)
        rank = expected_a.shape[0]
        with torch.no_grad():
            return (bool(torch.equal(layer.lora_a[slot, :rank], expected_a))
                    and bool(torch.equal(layer.lora_b[slot, :, :rank], expected_b))
                    and not bool(layer.lora_a[slot, rank:].any()) and not bool(layer.lora_b[slot, :, rank:].any()))

    @staticmethod
    def _slot_values(layer: _Layer, pair: dict[str, Tensor], scaling: float) -> tuple[Tensor, Tensor]:
        """What a factor pair is written into a slot as: A in the stack's dtype, B pre-scaled (`_write`)."""
        weight = layer.linear.weight
        lora_a = pair["lora_A"].to(weight.device, layer.lora_a.dtype)
        lora_b = pair["lora_B"].to(weight.device, torch.float32).mul(scaling).to(layer.lora_b.dtype)
        return lora_a, lora_b

    @contextlib.contextmanager
    def adapter_rows(self, adapters: Sequence[str | None], device: torch.device | str) -> Iterator[None]:
        """Forwards inside run row i with `adapters[i]`. All None (or no adapter loaded) leaves the hooks idle, so
        a base-only batch costs what the base model costs."""
        groups = None
        if any(name is not None for name in adapters):
            rows = self.slots(adapters, device)
            groups = (len(adapters), [(slot, (rows == slot).nonzero(as_tuple=True)[0])
                                      for slot in torch.unique(rows).tolist() if slot != BASE_SLOT])
        previous, self._groups = self._groups, groups
        try:
            yield
        finally:
            self._groups = previous

    # ----- loading -----------------------------------------------------------------------------------------

    def _check(self, name: str, named_tensors: Sequence[NamedTensor], scaling: float,
               adapter: _Adapter | None) -> dict[str, dict[str, Tensor]]:
        """Each layer's factor pair after the load, for the layers the load touches; raises naming the adapter and
        the tensor."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"adapter name must be a non-empty string, got {name!r}")
        if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not scaling > 0:
            raise ValueError(f"adapter {name!r}: scaling must be a number > 0, got {scaling!r}")
        if adapter is None and len(self._adapters) >= self._max_adapters:
            raise ValueError(f"adapter {name!r}: {self._max_adapters} adapters are loaded already (max_adapters; "
                             f"loaded: {sorted(self._adapters)}); remove one first")
        arriving: dict[str, dict[str, Tensor]] = {}
        for tensor_name, tensor in named_tensors:
            if not tensor_name.endswith(WIRE_SUFFIXES):
                raise ValueError(f"adapter {name!r}: {tensor_name!r} is not a LoRA factor (<module>.lora_A.weight "
                                 "or <module>.lora_B.weight)")
            module, factor = tensor_name.removesuffix(".weight").rpartition(".")[::2]
            linear = self._linears.get(module)
            if linear is None:
                raise ValueError(f"adapter {name!r}: {tensor_name!r}: the model has no linear layer {module!r}")
            if not isinstance(tensor, Tensor) or tensor.dim() != 2:
                shape = f"shape {tuple(tensor.shape)}" if isinstance(tensor, Tensor) else type(tensor).__name__
                raise ValueError(f"adapter {name!r}: {tensor_name!r} must be a matrix, got {shape}")
            if factor == "lora_A" and tensor.shape[1] != linear.in_features:
                raise ValueError(f"adapter {name!r}: {tensor_name!r} has shape {tuple(tensor.shape)}; the layer "
                                 f"takes {linear.in_features} inputs")
            if factor == "lora_B" and tensor.shape[0] != linear.out_features:
                raise ValueError(f"adapter {name!r}: {tensor_name!r} has shape {tuple(tensor.shape)}; the layer "
                                 f"has {linear.out_features} outputs")
            if factor in arriving.get(module, {}):
                raise ValueError(f"adapter {name!r}: {tensor_name!r} appears twice in one load")
            # A copy: a loader hands over views of receive buffers it reuses for the next bucket, and a later load
            # of the layer's other factor rewrites the slot from what is kept here.
            arriving.setdefault(module, {})[factor] = tensor.detach().clone()
        staged = {}
        for module, factors in arriving.items():
            pair = {**(adapter.factors.get(module, {}) if adapter else {}), **factors}
            missing = [factor for factor in FACTORS if factor not in pair]
            if missing:
                (present,) = (factor for factor in FACTORS if factor in pair)
                raise ValueError(f"adapter {name!r}: {module}.{present}.weight arrived without "
                                 f"{module}.{missing[0]}.weight")
            if pair["lora_A"].shape[0] != pair["lora_B"].shape[1]:
                raise ValueError(f"adapter {name!r}: {module}: lora_A has rank {pair['lora_A'].shape[0]}, lora_B "
                                 f"rank {pair['lora_B'].shape[1]}")
            staged[module] = pair
        return staged

    def _free_slot(self) -> int:
        taken = {adapter.slot for adapter in self._adapters.values()}
        return next(slot for slot in range(1, self._max_adapters + 1) if slot not in taken)

    def _write(self, module: str, slot: int, pair: dict[str, Tensor], scaling: float) -> None:
        layer = self._layers.get(module) or self._new_layer(module)
        rank = pair["lora_A"].shape[0]
        if rank > layer.lora_a.shape[1]:
            self._widen(layer, rank)
        lora_a, lora_b = self._slot_values(layer, pair, scaling)
        with torch.no_grad():
            layer.lora_a[slot].zero_()
            layer.lora_b[slot].zero_()
            layer.lora_a[slot, :rank].copy_(lora_a)
            layer.lora_b[slot, :, :rank].copy_(lora_b)

    def _new_layer(self, module: str) -> _Layer:
        linear = self._linears[module]
        slots, weight = self._max_adapters + 1, linear.weight
        dtype = linear.dtype if isinstance(linear, Fp8Linear) else weight.dtype  # an FP8 layer computes in its own
        layer = _Layer(linear, weight.new_zeros(slots, 0, linear.in_features, dtype=dtype),
                       weight.new_zeros(slots, linear.out_features, 0, dtype=dtype))
        layer.hook = linear.register_forward_hook(self._hook_for(layer))
        self._layers[module] = layer
        return layer

    @staticmethod
    def _widen(layer: _Layer, rank: int) -> None:
        """Zero-pad the layer's stacks to `rank`: the factors already there keep their values."""
        slots, old, inputs = layer.lora_a.shape
        outputs = layer.lora_b.shape[1]
        lora_a = layer.lora_a.new_zeros(slots, rank, inputs)
        lora_b = layer.lora_b.new_zeros(slots, outputs, rank)
        lora_a[:, :old] = layer.lora_a
        lora_b[:, :, :old] = layer.lora_b
        layer.lora_a, layer.lora_b = lora_a, lora_b

    # ----- serving -----------------------------------------------------------------------------------------

    def _hook_for(self, layer: _Layer) -> Callable[[nn.Module, tuple[Tensor, ...], Tensor], Tensor | None]:
        def add_adapters(_module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> Tensor | None:
            if self._groups is None:
                return None
            count, groups = self._groups
            (x,) = args
            if x.shape[0] != count:
                raise RuntimeError(f"a forward of {x.shape[0]} rows ran with adapters set for {count} rows")
            inputs = x.reshape(x.shape[0], -1, x.shape[-1])  # [rows, tokens, in]
            outputs = output.view(output.shape[0], -1, output.shape[-1])  # [rows, tokens, out], written in place
            for slot, rows in groups:
                down = inputs.index_select(0, rows) @ layer.lora_a[slot].T  # [its rows, tokens, rank]
                outputs.index_add_(0, rows, down @ layer.lora_b[slot].T)  # B scaled at load
            return output

        return add_adapters
