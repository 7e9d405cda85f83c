"""Mixture-of-experts models on the Megatron backend: settings, expert weight names, router-loss scaling, and
the norm that lets sequence parallelism run on megatron's local layer spec.

Experts. Without transformer-engine the local spec builds each layer's experts as megatron's `SequentialMLP`
(one MLP per local expert, `mlp.experts.local_experts.<e>.linear_fc1.weight`); mbridge knows only the grouped
layout (`mlp.experts.linear_fc1.weight<e>`). `grouped_expert_name` rewrites the first into the second, with the
expert's GLOBAL index when asked (expert parallelism: EP rank r holds experts r*n .. r*n+n-1), so mbridge's Qwen-MoE
mapping, its EP gather at export and its gate/up fusion serve both layouts. Expert tensor parallelism is either the
attention's TP (megatron's default) or 1 (slime's MoE scripts: --expert-tensor-parallel-size 1). mbridge loads a
SequentialMLP expert like an attention weight (TP rank 0 reads, scatters over the TP group), which is wrong once
the expert TP group is not the TP group, so the bridge loads experts itself over the expert TP group; at export
with ETP 1 mbridge gathers each expert over the TP group, whose copies are equal (`expert_merge`).

Sequence parallelism. megatron refuses MoE with TP > 1 unless activations are split over the TP ranks, and its
local spec's norm (`WrappedTorchNorm`) refuses that split. `SequenceParallelRMSNorm` is torch's RMSNorm with the
mark (`sequence_parallel` on its weight) through which megatron sums a norm's gradients over the TP ranks that each
saw part of the sequence: the same arithmetic, now allowed.

Two layouts out. A Hugging Face checkpoint stores each expert's projections apart (`experts.<e>.gate_proj.weight`,
as mbridge exports and SGLang loads them); transformers 5 holds a layer's experts as two stacked tensors
(`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]), and that is what the torch trainer sends and
what a torch engine's parameters are named. `engines.weights.layouts.ModelLayout` stacks the first into the
second (transformers' own conversion, read backwards: Mixtral's `block_sparse_moe.experts.<e>.w1` too), one
parameter at a time, where the installed transformers builds the model that way; an SGLang push takes the first.

Without transformer-engine. megatron-core 0.16.1's router calls `te_general_gemm` by a name it defines only when
transformer-engine imports (a NameError at the first MoE forward); `define_missing_te_gemm` defines it as None,
the value megatron tests for to take its plain matmul.

Router losses. slime's --moe-aux-loss-coeff and --moe-z-loss-coeff mean, on both backends, the MEAN over a step's
micro-batches (all data-parallel ranks) of megatron's per-micro-batch losses (`engines.training.moe` states the
torch side). megatron itself scales them for its per-token loss normalisation, which this trainer bypasses
(`engines.megatron.trainer`): multiplied by the micro-batch's token count, to be divided by the step's later. So
`RouterLossScale` switches that product off in every router and divides the coefficients by the step's number of
micro-batches instead; megatron's schedule leaves their backward scale at 1.

Routing replay (R3). megatron's routers ask a `router_replay` object for their top-k; `RoutingReplay` installs one
per router that takes the router's own choice and replaces it at the tokens whose samples carry engine routes.
"""

from __future__ import annotations

import contextlib
import itertools
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

MOE_FAMILIES = ("qwen3_moe", "mixtral")
_SEQUENTIAL_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.local_experts\.(\d+)\.(linear_fc[12]\.weight)$")
_ROUTER_COEFFICIENTS = ("moe_aux_loss_coeff", "moe_z_loss_coeff")


def is_moe(hf_config: PretrainedConfig) -> bool:
    return hf_config.model_type in MOE_FAMILIES


def num_experts(hf_config: PretrainedConfig) -> int:
    return int(getattr(hf_config, "num_experts", None) or hf_config.num_local_experts)


def moe_overrides(hf_config: PretrainedConfig, flags: Mapping[str, Any], *, grouped_gemm: bool) -> dict[str, Any]:
    """TransformerConfig settings of a Qwen3-MoE or Mixtral model as Hugging Face computes it, plus slime's router
    flags.

    Hugging Face's router takes the softmax over all experts, picks the top k and renormalises them when
    `norm_topk_prob` (Mixtral always does, and has no such field; mbridge's Mixtral config says otherwise);
    megatron's softmax router does the latter with `moe_router_pre_softmax=False` (softmax over the top-k logits,
    which is the same) and the former with True. The router losses default to off, as the torch
    backend's (slime's flags turn them on); "none" turns the load-balancing loss off whatever its coefficient.
    """
    if hf_config.model_type not in MOE_FAMILIES:
        raise ValueError(f"model_type {hf_config.model_type!r} is not a mixture-of-experts family the Megatron "
                         f"backend builds ({', '.join(MOE_FAMILIES)})")
    mlp_only = list(getattr(hf_config, "mlp_only_layers", None) or [])
    sparse_step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    if mlp_only or sparse_step != 1:
        raise ValueError(f"dense layers between MoE layers (mlp_only_layers={mlp_only}, decoder_sparse_step="
                         f"{sparse_step}) are not supported by the Megatron backend's bridge")
    balancing = flags.get("moe_router_load_balancing_type") or "aux_loss"
    if balancing not in ("aux_loss", "none"):
        raise ValueError(f"--moe-router-load-balancing-type {balancing}: the Megatron backend computes megatron's "
                         "micro-batch aux_loss only (or none), as the torch backend does")
    return {
        "moe_router_pre_softmax": not bool(getattr(hf_config, "norm_topk_prob", hf_config.model_type == "mixtral")),
        "moe_router_load_balancing_type": balancing,
        "moe_aux_loss_coeff": 0.0 if balancing == "none" else float(flags.get("moe_aux_loss_coeff") or 0.0),
        "moe_z_loss_coeff": float(flags.get("moe_z_loss_coeff") or 0.0) or None,
        "moe_token_dispatcher_type": flags.get("moe_token_dispatcher_type") or "alltoall",
        "moe_grouped_gemm": grouped_gemm,
        "moe_permute_fusion": False,
        "moe_router_dtype": "fp32",
        "moe_shared_expert_overlap": False,
    }


def define_missing_te_gemm() -> None:
    """See the module docstring; a no-op where transformer-engine (or a fixed megatron) defines the name."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def grouped_expert_name(name: str, *, expert_offset: int = 0) -> str:
    """A SequentialMLP expert weight under mbridge's grouped name (global index = local + `expert_offset`);
    any other name unchanged."""
    match = _SEQUENTIAL_EXPERT.match(name)
    if match is None:
        return name
    prefix, local, weight = match.groups()
    return f"{prefix}.{weight}{int(local) + expert_offset}"


def is_expert_weight(name: str) -> bool:
    """An expert's weight in either layout (local SequentialMLP name or mbridge's grouped name)."""
    return ".mlp.experts." in name and "shared" not in name


def is_local_expert_weight(name: str) -> bool:
    """A SequentialMLP expert's weight under its module name (`...mlp.experts.local_experts.<e>...`)."""
    return _SEQUENTIAL_EXPERT.match(name) is not None


def expert_merge(shards: list[Tensor], etp_size: int) -> Tensor | None:
    """The whole expert weight from the TP ranks' copies when experts are not tensor-parallel (they are equal);
    None: mbridge's own merge applies."""
    if etp_size == 1:
        return shards[0]
    return None


def checkpoint_expert_parallel_problem(saved: int, loading: int) -> str | None:
    """Why a MoE checkpoint saved at expert parallelism `saved` cannot load at `loading`, or None. megatron builds
    one optimizer for every parameter at EP 1 and a separate one for the experts at EP > 1; a checkpoint names its
    optimizer state after that structure, so it moves between EP sizes above 1 (and TP, DP, expert TP), not across
    EP 1 and EP > 1."""
    if (saved > 1) == (loading > 1):
        return None
    return (f"the checkpoint was saved at expert_model_parallel_size {saved} and cannot load at {loading}: megatron "
            "keeps the experts' optimizer state apart only under expert parallelism, so EP 1 and EP > 1 "
            "checkpoints differ in layout; resume at EP " + ("> 1" if saved > 1 else "1"))


class _LayerReplay:
    """What megatron's router asks its `router_replay` for the top-k: the router's own choice, except at the
    tokens given routes, which take those experts, weighted by the router's own scores there (so it still
    trains). megatron-core 0.16.1's `RouterReplay` replays every token or none; a packed row has tokens no engine
    routed (each sample's last, the padding), which route for themselves here."""

    def __init__(self) -> None:
        self.routes: Tensor | None = None  # [tokens, k] for this rank's tokens
        self.replayed: Tensor | None = None  # [tokens] bool
        self.recording = False
        self.chosen: Tensor | None = None  # what the last forward routed to, while recording

    def get_replay_topk(self, scores: Tensor, topk: int, num_groups: int | None = None,
                        group_topk: int | None = None, default_compute_topk: Any = None) -> tuple[Tensor, Tensor]:
        probs, chosen = default_compute_topk(scores, topk, num_groups, group_topk)
        if self.routes is not None and self.replayed is not None:
            if self.routes.shape != chosen.shape:
                raise ValueError(f"routing replay: routes of shape {tuple(self.routes.shape)} for a router that "
                                 f"chose {tuple(chosen.shape)} (tokens x top-k)")
            chosen = torch.where(self.replayed[:, None], self.routes.to(chosen.device), chosen)
            probs = scores.gather(1, chosen)
        if self.recording:
            self.chosen = chosen.detach()
        return probs, chosen


class RoutingReplay:
    """Replays rollout routes (R3) in the policy's forwards: each MoE layer's router picks the experts a
    micro-batch's samples were generated with (`MicroBatch.routes`), where they carry them."""

    def __init__(self, model: nn.Module) -> None:
        from megatron.core.transformer.moe.router import Router

        self._layers: list[tuple[int, _LayerReplay]] = []
        for module in model.modules():
            if isinstance(module, Router):
                replay = _LayerReplay()
                module.router_replay = replay
                self._layers.append((module.layer_number - 1, replay))

    @contextlib.contextmanager
    def routing(self, routes: Tensor | None, replayed: Tensor | None, *, tensor_parallel: int, rank: int,
                sequence_parallel: bool) -> Iterator[None]:
        """Inside, the routers replay `routes` ([tokens of the micro-batch, layers, k], megatron's token order);
        under sequence parallelism this TP rank's routers see its contiguous share of the tokens."""
        if routes is None or replayed is None:
            yield
            return
        if not self._layers:
            raise ValueError("routing replay: the model has no MoE router, but the samples carry routed_experts")
        if sequence_parallel and tensor_parallel > 1:
            share = routes.shape[0] // tensor_parallel
            routes, replayed = (routes[rank * share:(rank + 1) * share],
                                replayed[rank * share:(rank + 1) * share])
        for layer, replay in self._layers:
            if layer >= routes.shape[1]:
                raise ValueError(f"routing replay: the samples carry routes of {routes.shape[1]} MoE layers, the "
                                 f"model routes in layer {layer}")
            replay.routes, replay.replayed = routes[:, layer], replayed
        try:
            yield
        finally:
            for _, replay in self._layers:
                replay.routes = replay.replayed = None

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Inside, each router keeps what its last forward routed to (`chosen`)."""
        for _, replay in self._layers:
            replay.recording = True
        try:
            yield
        finally:
            for _, replay in self._layers:
                replay.recording, replay.chosen = False, None

    def chosen(self) -> dict[int, Tensor]:
        """Layer (0-based, over the whole model) -> the experts its router chose in the last forward on this rank
        ([this rank's tokens, k]): this pipeline stage's layers, while `recording`."""
        return {layer: replay.chosen for layer, replay in self._layers if replay.chosen is not None}


class RouteRecorder:
    """The experts every token of a batch was routed to in a forward of its micro-batches, for each sample
    `[len(tokens) - 1, layers, k]` (what its training forwards replay, the torch trainer's layout).

    Each rank writes what its own routers chose for its own tokens: its data-parallel share of the samples, its
    pipeline stage's layers, and under sequence parallelism its TP rank's share of each row (without it every TP
    rank routes alike and rank 0 writes). Entries are written plus one, so a sum over the world assembles the
    whole batch on every rank (COLLECTIVE `finish`) and a zero left says no rank wrote it."""

    def __init__(self, samples: Sequence[Any], layers: int, top_k: int, device: torch.device, *,
                 tensor_parallel: int, tp_rank: int, sequence_parallel: bool) -> None:
        self._lengths = [int(sample.tokens.numel()) for sample in samples]
        self._offsets = [0, *itertools.accumulate(self._lengths)]
        self._routes = torch.zeros((self._offsets[-1], layers, top_k), dtype=torch.int32, device=device)
        self._split = sequence_parallel and tensor_parallel > 1
        self._writes = self._split or tp_rank == 0
        self._tensor_parallel, self._tp_rank = tensor_parallel, tp_rank

    def record(self, members: Sequence[int], token_starts: Sequence[tuple[int, int]], shape: tuple[int, int],
               chosen: dict[int, Tensor]) -> None:
        """One micro-batch's routes: its samples `members` start at `token_starts` of its [rows, width] `shape`;
        `chosen[layer]` covers this rank's tokens of it in megatron's order (sequence-major, `RoutingReplay`)."""
        if not self._writes or not chosen:
            return
        rows, width = shape
        share = rows * width // (self._tensor_parallel if self._split else 1)
        first = share * self._tp_rank if self._split else 0
        device = self._routes.device
        for member, (row, column) in zip(members, token_starts, strict=True):
            steps = torch.arange(self._lengths[member], device=device)
            positions = (column + steps) * rows + row  # sequence-major, as megatron orders tokens
            mine = (positions >= first) & (positions < first + share)
            targets = self._offsets[member] + steps[mine]
            for layer, experts in chosen.items():
                self._routes[targets, layer] = experts[positions[mine] - first].to(torch.int32) + 1

    def finish(self) -> list[Tensor]:
        """Every sample's routes, on every rank (on the CPU). COLLECTIVE."""
        from engines.megatron import collectives

        routes = collectives.sum_over_world(self._routes).cpu() - 1
        if routes.numel() and int(routes.min()) < 0:
            raise RuntimeError("routing replay: no rank recorded the routes of some tokens (a layer without a router, "
                               "or a micro-batch that was not run)")
        return [sample[:-1].to(torch.int16) for sample in routes.split(self._lengths)]


class RouterLossScale:
    """Per step, the router-loss coefficients megatron reads at each forward (see the module docstring), and the
    losses' values as the torch trainer reports them (`moe/load_balancing_loss`, `moe/z_loss`: the mean over
    layers and micro-batches, coefficients left out)."""

    def __init__(self, model: nn.Module, transformer_config: Any) -> None:
        from megatron.core.transformer.moe.router import Router

        self._config = transformer_config
        self._coefficients = {name: getattr(transformer_config, name) for name in _ROUTER_COEFFICIENTS}
        self._routers = [module for module in model.modules() if isinstance(module, Router)]
        for router in self._routers:
            router.calculate_per_token_loss = False

    @property
    def moe(self) -> bool:
        """Whether the model has routers at all."""
        return bool(self._routers)

    @property
    def active(self) -> bool:
        return bool(self._routers) and any(self._coefficients.values())

    def for_step(self, micro_batches: int) -> None:
        """Coefficients for a step of `micro_batches` micro-batches over all data-parallel ranks."""
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        clear_aux_losses_tracker()
        for name, value in self._coefficients.items():
            if value:
                setattr(self._config, name, value / max(micro_batches, 1))

    @contextlib.contextmanager
    def silenced(self, silent: bool = True) -> Iterator[None]:
        """No router loss in the forwards inside (a filler micro-batch's: `engines.megatron.batches`)."""
        if not silent or not self.active:
            yield
            return
        saved = {name: getattr(self._config, name) for name in _ROUTER_COEFFICIENTS}
        self._config.moe_aux_loss_coeff, self._config.moe_z_loss_coeff = 0.0, None
        try:
            yield
        finally:
            for name, value in saved.items():
                setattr(self._config, name, value)

    def metrics(self, micro_batches: int, *, tensor_parallel: int) -> dict[str, float]:
        """The step's router losses from megatron's tracker, over every rank. COLLECTIVE.

        Each rank's tracker holds, per layer of its pipeline stage, the sum over its micro-batches of its share:
        under sequence parallelism a TP rank's load-balancing term is a part of the sum (parts add up) and its
        z-loss a mean over its rows (means average), so TP ranks weigh 1 and 1/TP; ranks of other stages add
        their layers, data-parallel ranks their micro-batches."""
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        from engines.megatron import collectives

        tracker = get_moe_layer_wise_logging_tracker()
        layers = self._config.num_layers
        wanted = [(metric, tracker_name, weight) for metric, tracker_name, weight, coefficient in (
            ("moe/load_balancing_loss", "load_balancing_loss", 1.0, "moe_aux_loss_coeff"),
            ("moe/z_loss", "z_loss", 1.0 / tensor_parallel, "moe_z_loss_coeff")) if self._coefficients[coefficient]]
        values = torch.zeros(len(wanted))
        for index, (_, tracker_name, weight) in enumerate(wanted):
            if tracker_name in tracker:
                values[index] = float(tracker[tracker_name]["values"].sum()) * weight
        totals = collectives.sum_over_world(values) / (max(micro_batches, 1) * layers)
        return {metric: float(total) for (metric, _, _), total in zip(wanted, totals, strict=True)}

    def loss_term(self, metrics: dict[str, float]) -> float:
        """What the router losses add to the step's loss, from `metrics()`: each coefficient times its loss summed
        over the layers, as the torch trainer adds them, so "loss" means the same on both backends."""
        return self._config.num_layers * sum(
            (self._coefficients[coefficient] or 0.0) * metrics.get(metric, 0.0) for metric, coefficient in (
                ("moe/load_balancing_loss", "moe_aux_loss_coeff"), ("moe/z_loss", "moe_z_loss_coeff")))


class SequenceParallelRMSNorm(nn.RMSNorm):
    """torch's RMSNorm, built the way megatron builds norms, whose weight megatron may sum over the TP ranks."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        if config.normalization != "RMSNorm":
            raise ValueError(f"normalization {config.normalization!r}: the local spec's sequence-parallel norm is "
                             "RMSNorm only")
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]
