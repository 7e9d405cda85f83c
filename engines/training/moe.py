"""The router losses of mixture-of-experts models on the torch backend, computed as megatron-core computes them.

Hugging Face MoE models compute a load-balancing loss of their own, but over every layer's tokens concatenated and
without megatron's division by top-k, and only when asked through `labels`; slime's `--moe-aux-loss-coeff` and
`--moe-z-loss-coeff` mean megatron's per-layer losses, summed over the layers. So the trainer reads each router's
logits and its chosen experts from the training forward itself (forward hooks on the routers: no second forward,
and the fused output head and packed rows stay as they are) and adds

    aux coeff x sum over layers of E / (k T^2) x sum_e (sum_t p_te) (tokens routed to e)
    z coeff   x sum over layers of mean_t logsumexp(router logits_t)^2

for one micro-batch (a packed row: its T tokens are all real, prompts and responses, as megatron counts them). A
step's router loss is the mean over its micro-batches on every rank (each rank's gradients are summed), as
megatron's scaling of the auxiliary loss by the number of micro-batches makes it.

Routers are found the way transformers itself records router logits (`_can_record_outputs["router_logits"]`), and
the losses need routers that return (logits, weights, chosen experts), as the softmax top-k routers of Qwen-MoE,
Mixtral and OLMoE do; a router that chooses elsewhere (DeepSeek-V3's grouped, biased choice) is refused by name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class RouterLossSettings:
    """slime's (megatron's) `--moe-aux-loss-coeff` and `--moe-z-loss-coeff`; 0 turns a loss off."""

    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0

    @property
    def active(self) -> bool:
        return self.aux_loss_coeff > 0 or self.z_loss_coeff > 0


def base_of(model: nn.Module) -> nn.Module:
    """The HF model under a LoRA (PEFT) wrapper, or the model itself."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def router_modules(model: nn.Module) -> list[nn.Module]:
    """The model's MoE routers in layer order; empty for a dense model."""
    recorder = getattr(type(base_of(model)), "_can_record_outputs", None) or {}
    router = recorder.get("router_logits")
    router_class = getattr(router, "target_class", None)
    if router_class is None:
        return []
    return [module for module in model.modules() if isinstance(module, router_class)]


@dataclass
class RoutedLayer:
    logits: Tensor  # [tokens, experts], with gradients
    chosen: Tensor  # [tokens, k] expert indices


class RouterLosses:
    """Adds the router losses of `settings` to each training micro-batch of `model` (see the module docstring)."""

    def __init__(self, model: nn.Module, settings: RouterLossSettings, *, world_size: int) -> None:
        self._routers = router_modules(model)
        if not self._routers:
            raise ValueError(f"--moe-aux-loss-coeff/--moe-z-loss-coeff: {type(base_of(model)).__name__} has no MoE "
                             "router (a dense model); drop the flags")
        self.settings = settings
        self._world_size = world_size
        self._layers: list[RoutedLayer] | None = None
        for router in self._routers:
            router.register_forward_hook(self._record)

    def _record(self, module: nn.Module, _inputs: tuple[Tensor, ...], output: object) -> None:
        if self._layers is None:
            return
        if not (isinstance(output, tuple) and len(output) == 3):
            raise ValueError(f"{type(module).__name__}: the router losses need a router that returns (logits, "
                             "weights, chosen experts); this one chooses its experts elsewhere (grouped or biased "
                             "routing), so --moe-aux-loss-coeff/--moe-z-loss-coeff cannot be computed for it")
        logits, _weights, chosen = output
        self._layers.append(RoutedLayer(logits, chosen))

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[RoutedLayer]]:
        """Collects every router's output during the forward inside the block."""
        self._layers = layers = []
        try:
            yield layers
        finally:
            self._layers = None

    def loss(self, layers: list[RoutedLayer], micro_batches: int) -> tuple[Tensor, dict[str, float]]:
        """This micro-batch's share of the step's router loss, and its metrics (per-layer means, unweighted by the
        coefficients, as megatron logs them) as sums over micro-batches, like every other additive metric."""
        if len(layers) != len(self._routers):
            raise RuntimeError(f"router losses: {len(layers)} router outputs recorded in a forward of a model with "
                               f"{len(self._routers)} routers")
        aux = torch.stack([load_balancing_loss(layer.logits, layer.chosen) for layer in layers])
        z = torch.stack([z_loss(layer.logits) for layer in layers])
        total = self.settings.aux_loss_coeff * aux.sum() + self.settings.z_loss_coeff * z.sum()
        share = 1.0 / (micro_batches * self._world_size)
        metrics = {"moe/load_balancing_loss": float(aux.detach().mean()) * share,
                   "moe/z_loss": float(z.detach().mean()) * share}
        return total * share, metrics


def load_balancing_loss(logits: Tensor, chosen: Tensor) -> Tensor:
    """megatron's switch load-balancing loss of one layer, coefficient 1: E / (k T^2) sum_e P_e f_e."""
    tokens, experts = logits.shape
    probs = torch.softmax(logits.float(), dim=-1)
    routed = torch.zeros(experts, dtype=torch.float32, device=logits.device)
    routed.scatter_add_(0, chosen.reshape(-1), torch.ones(chosen.numel(), device=logits.device))
    return (probs.sum(0) * routed).sum() * (experts / (chosen.shape[-1] * tokens * tokens))


def z_loss(logits: Tensor) -> Tensor:
    """ST-MoE's router z-loss of one layer, coefficient 1: the mean of logsumexp(logits)^2 over tokens."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()
