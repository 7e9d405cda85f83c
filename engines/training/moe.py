"""Mixture-of-experts routers on the torch backend: megatron's router losses, and routing replay.

Router losses. Hugging Face MoE models compute a load-balancing loss of their own, but over every layer's tokens
concatenated and without megatron's division by top-k, and only when asked through `labels`; slime's
`--moe-aux-loss-coeff` and `--moe-z-loss-coeff` mean megatron's per-layer losses, summed over the layers. So the
trainer reads each router's logits and its chosen experts from the training forward itself (a forward hook on each
router: no second forward, and the fused output head and packed rows stay as they are) and adds

    aux coeff x sum over layers of E / (k T^2) x sum_e (sum_t p_te) (tokens routed to e)
    z coeff   x sum over layers of mean_t logsumexp(router logits_t)^2

for one micro-batch (a packed row: its T tokens are all real, prompts and responses, as megatron counts them). A
step's router loss is the mean over its micro-batches on every rank (each rank's gradients are summed), as
megatron's scaling of the auxiliary loss by the number of micro-batches makes it.

Routing replay. A sample may carry the experts each of its tokens was routed to by another forward (the engine's
during generation, or the learner's first forward); a policy forward then routes those tokens there instead of
where its own router would, with the router's own probabilities at the replayed experts as their weights (so the
router still gets gradients), as slime's replay does. The reference and teacher forwards route for themselves.

Routers are found the way transformers itself records router logits (`_can_record_outputs["router_logits"]`); both
features need routers that return (logits, weights, chosen experts), as the softmax top-k routers of Qwen-MoE,
Mixtral and OLMoE do; a router that chooses elsewhere (DeepSeek-V3's grouped, biased choice) is refused by name.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed
from torch import Tensor, nn

from engines.training.base import TrainSample
from engines.training.micro_batches import PackedInputs


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


class Routers:
    """A model's MoE routers, each with one forward hook through which a forward's routing is replaced (routing
    replay: `replaying`) and read (router losses, recorded routes: `tapped`). Replay comes first, so what is read is
    the routing the forward used."""

    def __init__(self, model: nn.Module, *, wanted_by: str) -> None:
        self.modules = router_modules(model)
        if not self.modules:
            raise ValueError(f"{wanted_by}: {type(base_of(model)).__name__} has no MoE router (a dense model); drop "
                             "the flags")
        self.top_k = int(self.modules[0].top_k)
        self._taps: list[list[RoutedLayer]] = []
        self._replay: tuple[Tensor, Tensor] | None = None
        for layer, module in enumerate(self.modules):
            module.register_forward_hook(functools.partial(self._hook, layer))

    def _hook(self, layer: int, module: nn.Module, _inputs: tuple[Tensor, ...], output: object) -> object:
        if not self._taps and self._replay is None:
            return None
        if not (isinstance(output, tuple) and len(output) == 3):
            raise ValueError(f"{type(module).__name__}: router losses and routing replay need a router that returns "
                             "(logits, weights, chosen experts); this one chooses its experts elsewhere (grouped or "
                             "biased routing)")
        logits, weights, chosen = output
        if self._replay is not None:
            routes, replayed = self._replay
            chosen = torch.where(replayed[:, None], routes[:, layer].to(chosen.dtype), chosen)
            probs = torch.softmax(logits.float(), dim=-1).gather(-1, chosen)
            if getattr(module, "norm_topk_prob", True):  # Mixtral always renormalises; the Qwen routers may
                probs = probs / probs.sum(dim=-1, keepdim=True)
            weights = probs.to(weights.dtype)
        for tap in self._taps:
            tap.append(RoutedLayer(logits, chosen))
        return logits, weights, chosen

    @contextlib.contextmanager
    def tapped(self) -> Iterator[list[RoutedLayer]]:
        """Every router's logits and chosen experts of the forward inside the block, in layer order."""
        layers: list[RoutedLayer] = []
        self._taps.append(layers)
        try:
            yield layers
        finally:
            self._taps.remove(layers)

    @contextlib.contextmanager
    def replaying(self, routes: Tensor, replayed: Tensor) -> Iterator[None]:
        """The forward inside the block routes token t of its row to `routes[t, layer]` ([tokens, layers, k])
        wherever `replayed[t]`, and chooses for itself elsewhere."""
        if routes.shape[1:] != (len(self.modules), self.top_k):
            raise ValueError(f"routing replay: routes of shape {tuple(routes.shape)} for a model with "
                             f"{len(self.modules)} MoE layers of top-{self.top_k} routing")
        self._replay = (routes, replayed)
        try:
            yield
        finally:
            self._replay = None


class RouterLosses:
    """Adds the router losses of `settings` to each training micro-batch (see the module docstring)."""

    def __init__(self, routers: Routers, settings: RouterLossSettings, *, row_group: Any = None) -> None:
        """`row_group`: the ranks each row is split across (context parallelism; None: none), whose tokens make up
        one row's losses."""
        self.routers = routers
        self.settings = settings
        self._row_group = row_group

    def loss(self, layers: list[RoutedLayer], micro_batches: int) -> tuple[Tensor, dict[str, float]]:
        """This micro-batch's share of the step's router loss, and its metrics (per-layer means, unweighted by the
        coefficients, as megatron logs them) as sums over micro-batches, like every other additive metric.
        `micro_batches`: the step's over every data-parallel rank, which may hold different numbers of them (their
        gradients are summed): each micro-batch weighs the same, as in one process."""
        if len(layers) != len(self.routers.modules):
            raise RuntimeError(f"router losses: {len(layers)} router outputs recorded in a forward of a model with "
                               f"{len(self.routers.modules)} routers")
        aux = torch.stack([load_balancing_loss(layer.logits, layer.chosen, row_group=self._row_group)
                           for layer in layers])
        z = torch.stack([z_loss(layer.logits, row_group=self._row_group) for layer in layers])
        total = self.settings.aux_loss_coeff * aux.sum() + self.settings.z_loss_coeff * z.sum()
        share = 1.0 / micro_batches
        means = torch.stack([aux.detach().mean(), z.detach().mean()])
        if self._row_group is not None:  # each rank's terms are its tokens' parts of the row's losses
            row = torch.cat([means, total.detach().reshape(1)])
            torch.distributed.all_reduce(row, group=self._row_group)
            means = row[:2]
            # the row's loss in value, as every rank reports its micro-batch's; this rank's part in gradient
            total = total + (row[2] - total).detach()
        metrics = {"moe/load_balancing_loss": float(means[0]) * share, "moe/z_loss": float(means[1]) * share}
        return total * share, metrics


def carries_routes(samples: Sequence[TrainSample]) -> bool:
    return any(sample.routed_experts is not None for sample in samples)


def row_routes(samples: Sequence[TrainSample], inputs: PackedInputs) -> tuple[Tensor, Tensor] | None:
    """The routes to replay in the packed row of `samples` ([row tokens, layers, k]) and which row positions have
    one, from the samples' `routed_experts`; None when no sample carries routes. A prompt packed once takes the
    routes of the first sample that holds it."""
    if not carries_routes(samples):
        return None
    carried = [sample.routed_experts for sample in samples]
    missing = [index for index, routes in enumerate(carried) if routes is None]
    if missing:
        raise ValueError(f"routing replay: samples {missing[:5]} of a micro-batch carry no routes while others do")
    assert inputs.token_positions is not None, "pack the row with_token_positions to replay routes"
    starts = [0]
    for sample in samples[:-1]:
        starts.append(starts[-1] + sample.tokens.numel())
    present = [routes for routes in carried if routes is not None]  # all of them, as checked above
    positions = torch.cat([inputs.token_positions[start:start + routes.shape[0]]
                           for start, routes in zip(starts, present, strict=True)])
    values = torch.cat(present).to(positions.device, torch.long)
    tokens = inputs.input_ids.shape[-1]
    routes = torch.zeros((tokens, *values.shape[1:]), dtype=torch.long, device=positions.device)
    replayed = torch.zeros(tokens, dtype=torch.bool, device=positions.device)
    order = torch.arange(positions.numel(), device=positions.device)
    first = torch.full((tokens,), positions.numel(), device=positions.device).scatter_reduce(
        0, positions, order, reduce="amin")
    keep = first[positions] == order  # a shared position takes its first sample's routes (index_put picks any)
    routes[positions[keep]] = values[keep]
    replayed[positions] = True
    return routes, replayed


def sample_routes(layers: list[RoutedLayer], samples: Sequence[TrainSample], inputs: PackedInputs) -> list[Tensor]:
    """Each sample's routes ([len(tokens) - 1, layers, k], on the CPU) from a forward of their packed row: what a
    later forward replays (`row_routes`)."""
    assert inputs.token_positions is not None, "pack the row with_token_positions to record routes"
    chosen = torch.stack([layer.chosen for layer in layers], dim=1)  # [row tokens, layers, k]
    per_sample = chosen[inputs.token_positions].cpu().split([sample.tokens.numel() for sample in samples])
    return [routes[:-1].to(torch.int16) for routes in per_sample]


def load_balancing_loss(logits: Tensor, chosen: Tensor, *, row_group: Any = None) -> Tensor:
    """megatron's switch load-balancing loss of one layer, coefficient 1: E / (k T^2) sum_e P_e f_e.

    With `row_group` (a row split across ranks), `logits` are this rank's tokens: T and the routed counts f_e are
    the whole row's (summed over the group, no gradient), and the result is this rank's part of the sum over P_e,
    so the group's parts add up to the row's loss and each one's gradient is the row loss's in its tokens."""
    tokens, experts = logits.shape
    probs = torch.softmax(logits.float(), dim=-1)
    routed = torch.zeros(experts + 1, dtype=torch.float32, device=logits.device)
    routed.scatter_add_(0, chosen.reshape(-1), torch.ones(chosen.numel(), device=logits.device))
    routed[experts] = tokens
    if row_group is not None:
        torch.distributed.all_reduce(routed, group=row_group)
    tokens = float(routed[experts])
    return (probs.sum(0) * routed[:experts]).sum() * (experts / (chosen.shape[-1] * tokens * tokens))


def z_loss(logits: Tensor, *, row_group: Any = None) -> Tensor:
    """ST-MoE's router z-loss of one layer, coefficient 1: the mean of logsumexp(logits)^2 over tokens (with
    `row_group`, over the whole row's: this rank's part of the mean)."""
    squares = torch.logsumexp(logits.float(), dim=-1).square()
    if row_group is None:
        return squares.mean()
    tokens = torch.tensor([float(squares.numel())], device=logits.device)
    torch.distributed.all_reduce(tokens, group=row_group)
    return squares.sum() / tokens[0]
