"""The weights a torch engine serves and how an update lands in them: full tensors copied in place, a one-policy
LoRA run's adapter merged into its layers (`lora_merge.py`), named adapters served unmerged beside them
(`multi_lora.py`), and the fingerprints of what is served now.

Every load checks all of its tensors before it writes any, so a bad bucket changes nothing. The engine calls these
from its decode thread between two steps, and then voids the keys and values computed before.

The fingerprints are taken on another thread, beside generation (a push's loader resumes generation once the
weights are in, then asks for them): decoding only reads the weights, and every write to them here (a load, an
adapter's load or unload) holds the same lock as a fingerprint, so none lands in the middle of one; a load that
arrives meanwhile waits for it. The one write made elsewhere, a delta written in place into `delta_target`, is made
by the receive of the next push from the same loader, which starts only after this push's fingerprint answered.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from engines.inference.fp8_linear import merge_target, refresh_changed
from engines.inference.lora_merge import AdapterMerger, is_adapter
from engines.inference.multi_lora import MultiLora
from engines.weights import fp8, layouts
from engines.weights.fingerprint import FingerprintPlan, ServedPrints, comparable_dtype
from engines.weights.manifest import TensorSpec

logger = logging.getLogger(__name__)

NamedTensor = tuple[str, torch.Tensor]


class ServedWeights:
    """`lora_scaling`: the run's `lora_alpha / lora_rank`, None when the engine was started without LoRA settings
    (then adapters are refused rather than applied at an unknown scale). `fresh_adapters`: named adapters served
    before their first load, as the base weights (a fresh LoRA adapter's B is zero: it computes what the base does),
    so a policy generates before its learner's first push."""

    def __init__(self, model: nn.Module, *, lora_scaling: float | None, max_adapters: int,
                 fresh_adapters: Iterable[str] = ()) -> None:
        self._model = model
        self.parameters = model.state_dict(keep_vars=True)
        self._merged = AdapterMerger(self.parameters, lora_scaling, merge_target(model, self.parameters))
        self._lora_scaling = lora_scaling
        self.named_adapters = MultiLora(model, max_adapters=max_adapters)
        fresh = list(fresh_adapters)
        if len(set(fresh)) != len(fresh) or not all(isinstance(name, str) and name for name in fresh):
            raise ValueError(f"adapters must be distinct non-empty names, got {fresh!r}")
        if len(fresh) > max_adapters:
            raise ValueError(f"{len(fresh)} adapters ({', '.join(fresh)}) exceed max_adapters={max_adapters}")
        self._fresh_adapters = frozenset(fresh)
        self._max_adapters = max_adapters
        self._checkpoint_views: dict[str, torch.Tensor] | None = None  # made at the first checkpoint-named load
        self._writing = threading.Lock()  # held by every write to the weights and by their fingerprints

    def load(self, named_tensors: Iterable[NamedTensor]) -> None:
        """Full tensors by the model's or its checkpoint's names, and a one-policy run's LoRA factors, merged."""
        with self._writing:
            self._load(named_tensors)

    def _load(self, named_tensors: Iterable[NamedTensor]) -> None:
        updates, adapters = [], []
        for name, tensor in named_tensors:
            (adapters if is_adapter(name) else updates).append((name, tensor))
        self._merged.check(adapters)
        for name, tensor in updates:
            target = self.weight(name)
            if target is None:
                raise ValueError(f"update_weights: {name!r} is not a weight of this model")
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"update_weights: {name!r} is a {type(tensor).__name__}, expected a tensor")
            if tensor.shape != target.shape:
                raise ValueError(
                    f"update_weights: {name!r} has shape {tuple(tensor.shape)}, the model's is {tuple(target.shape)}"
                )
            if (tensor.dtype == fp8.FP8) != (target.dtype == fp8.FP8):  # a cast between them has no scale
                raise ValueError(f"update_weights: {name!r} arrives as {tensor.dtype}, served as {target.dtype}: the "
                                 "learner and this engine disagree on FP8 rollout (--rollout-fp8)")
            if target.dtype == fp8.FP8 and self._merged.merges(name):
                raise ValueError(f"update_weights: {name!r}: a new FP8 base under a merged LoRA adapter is not "
                                 "supported (a LoRA run pushes its adapter only)")
        with torch.no_grad():
            for name, tensor in updates:
                if not self._merged.rebase(name, tensor):
                    self.weight(name).copy_(tensor)  # type: ignore[union-attr]  # checked above
        self._merged.apply(adapters)
        refresh_changed(self._model)  # FP8 layers compute with the bytes just loaded

    def load_adapter(self, adapter: str, named_tensors: Sequence[NamedTensor]) -> None:
        """The LoRA factors of the adapter named `adapter`, loaded (or updated in place) unmerged, the others
        untouched (`MultiLora.load`)."""
        if self._lora_scaling is None:
            raise ValueError(f"update_weights: adapter {adapter!r}: this engine was started without LoRA settings "
                             "(--lora-rank, --lora-alpha), so it cannot scale an adapter")
        for name, _ in named_tensors:
            if not is_adapter(name):
                raise ValueError(f"update_weights: adapter {adapter!r}: {name!r} is not a LoRA factor; a named "
                                 "adapter's update holds <module>.lora_A.weight and <module>.lora_B.weight only")
        with self._writing:
            self.named_adapters.load(adapter, named_tensors, self._lora_scaling)

    def serves(self, adapter: str) -> bool:
        """Whether a request may name `adapter`: loaded, or fresh (served as the base weights until loaded)."""
        return adapter in self.named_adapters or adapter in self._fresh_adapters

    def serve_fresh(self, adapter: str) -> None:
        """Serve `adapter` as the base weights until its first load; nothing changes if it is served already."""
        if not isinstance(adapter, str) or not adapter:
            raise ValueError(f"serve_adapter: adapter must be a non-empty name, got {adapter!r}")
        if self.serves(adapter):
            return
        served = sorted({*self.named_adapters.names, *self._fresh_adapters})
        if len(served) >= self._max_adapters:
            raise ValueError(f"serve_adapter: adapter {adapter!r}: the engine serves {len(served)} adapters "
                             f"({', '.join(served)}), its most (max_adapters)")
        self._fresh_adapters |= {adapter}

    def unload_adapter(self, adapter: str, users: Sequence[str]) -> None:
        """Stop serving `adapter`, loaded or fresh; refused while requests (`users`, their ids) still generate with
        it."""
        if not self.serves(adapter):
            raise ValueError(f"unload_adapter: adapter {adapter!r} is not served (served: "
                             f"{sorted({*self.named_adapters.names, *self._fresh_adapters})})")
        if users:
            raise ValueError(f"unload_adapter: adapter {adapter!r} serves {len(users)} requests in flight "
                             f"({', '.join(map(repr, users[:3]))}{' ...' if len(users) > 3 else ''}); abort or finish "
                             "them first")
        with self._writing:
            if adapter in self.named_adapters:
                self.named_adapters.remove(adapter)
            self._fresh_adapters -= {adapter}

    def fingerprints(self, specs: tuple[TensorSpec, ...], plan: FingerprintPlan,
                     adapter: str | None = None) -> ServedPrints:
        """What is served now under the sender's names: a weight as it is, a merged LoRA factor only where its layer
        still equals the merge (`AdapterMerger.served`); with `adapter`, the named adapter's factors only where its
        slot holds them (`MultiLora.served`). Safe beside generation, on any thread (see the module docstring)."""
        with self._writing, torch.inference_mode():
            return self._fingerprints(specs, plan, adapter)

    def _fingerprints(self, specs: tuple[TensorSpec, ...], plan: FingerprintPlan,
                      adapter: str | None) -> ServedPrints:
        prints, unchecked = plan.prints(), {}
        specs = plan.covered(specs)
        factors = [spec.name for spec in specs if is_adapter(spec.name)]
        adapters = self._merged.served(factors) if adapter is None else self.named_adapters.served(adapter, factors)
        for spec in specs:
            served = adapters.get(spec.name) if is_adapter(spec.name) else self.weight(spec.name)
            if served is None:
                continue  # absent: the sender names it as served differently
            if not comparable_dtype(spec.dtype, served.dtype):
                unchecked[spec.name] = f"served as {served.dtype}, sent as {spec.dtype}"
                continue
            prints.add(spec.name, served, spec.dtype)
        return ServedPrints(prints.values(), unchecked)

    def delta_target(self, name: str) -> torch.Tensor | None:
        """The weight itself, unless an adapter is merged into it (it serves base + adapter, not what was pushed) or
        `name` is an adapter's factor."""
        if is_adapter(name) or self._merged.merges(name):
            return None
        return self.weight(name)

    def weight(self, name: str) -> torch.Tensor | None:
        """The served tensor a name loads into: the model's own name, or its checkpoint's (a stacked layer's expert
        is a slice of its parameter), as an SGLang server takes either kind of a checkpoint's names."""
        weight = self.parameters.get(name)
        if weight is not None:
            return weight
        if self._checkpoint_views is None:
            try:
                self._checkpoint_views = layouts.checkpoint_views(self._model)
            except ValueError as error:
                logger.warning("checkpoint names will not load into this model: %s", error)
                self._checkpoint_views = {}
        return self._checkpoint_views.get(name)
