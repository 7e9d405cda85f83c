"""The embedded torch trainer: a Hugging Face causal LM, AdamW, packed micro-batches, DDP over torch.distributed.

Data parallelism. Several learner processes each call the same methods with their own shard of samples; the
caller initialises the default process group (gloo on CPU, NCCL on GPU). Losses are normalised by counts of
the whole step, which the `Loss` object carries (see `engines.training.base`), so the gradients of all
micro-batches of all ranks must be SUMMED; DDP averages by default, so a communication hook replaces its
all-reduce with a plain sum. Only the last micro-batch of a step synchronises (`no_sync` before), so ranks may
hold different numbers of micro-batches.

Determinism of the policy: dropout is switched off at load (`engines.training.hf_models`).

LoRA (`config.lora`): the model is wrapped by PEFT and only the adapter trains. The adapter is all that a
checkpoint stores beside the optimizer, all that `named_tensors` sends, and the reference model is the policy
with its adapter switched off (no second copy of the weights) unless another reference model is named.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, load_model, save_file, save_model
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from engines import frozen_params
from engines.training import checkpoint, hf_models, lora, mtp, reference, vision
from engines.training.attention import NAME as PACKED_ATTENTION
from engines.training.base import (
    DataParallel,
    Loss,
    ModelOutputs,
    ModelRole,
    StepResult,
    StepStats,
    Trainer,
    TrainSample,
    ValueLossFn,
    VersionCounter,
    WeightLayout,
    check_loss,
    scheduled_lr,
    select_model,
    skip_reason,
    step_result,
    validate_samples,
)
from engines.training.config import TorchTrainerConfig
from engines.training.context_parallel import ContextParallel
from engines.training.critic import CRITIC_DIRECTORY, ValueCritic
from engines.training.data_parallel import summing_ddp
from engines.training.micro_batches import (
    PackedInputs,
    check_packing_isolation,
    collate,
    count_loss_tokens,
    pack_inputs,
    plan_micro_batches,
    plan_shared_micro_batches,
)
from engines.training.moe import (
    RoutedLayer,
    RouterLosses,
    RouterLossSettings,
    Routers,
    carries_routes,
    router_modules,
    row_routes,
    sample_routes,
)
from engines.training.optimizers import build_adam, param_groups
from engines.training.output_head import fuse_output_head, token_outputs
from engines.weights import layouts


class TorchTrainer(Trainer):
    """See the module docstring. Construct on every learner rank after `torch.distributed` is initialised."""

    def __init__(self, config: TorchTrainerConfig) -> None:
        self.config = config
        self._device = _resolve_device(config.device)
        torch.manual_seed(config.seed)
        self._model = hf_models.load_model(config.model_path, self._device, config.attn_implementation)
        vision.check_supported(self._model, config)
        vision.freeze_tower(self._model, freeze=config.freeze_vision_tower)
        # MTP depths copy the last decoder layer as loaded: before adapters or checkpointing wrap it
        self._mtp = mtp.MultiTokenPredictor(self._model, config.mtp, config.model_path) if config.mtp else None
        if config.lora is not None:
            self._model = lora.wrap(self._model, config.lora, exclude=vision.lora_exclusions(self._model))
        self._ref = None
        # The reference of a LoRA run is its base model: the policy with the adapter off, not a second copy.
        self._ref_is_base = config.lora is not None and config.ref_model_path == config.model_path
        if config.ref_model_path is not None and not self._ref_is_base:
            self._ref = hf_models.load_model(config.ref_model_path, self._device, config.attn_implementation)
            self._ref.requires_grad_(False)
        # Distillation teachers: frozen like the reference, scored before the batch trains (`compute_log_probs`).
        self._teachers = {name: hf_models.load_model(path, self._device, config.attn_implementation)
                          .requires_grad_(False) for name, path in config.teacher_model_paths.items()}
        self._share_prompts = (config.share_prompts and config.attn_implementation == PACKED_ATTENTION
                               and self._mtp is None)  # MTP reads each sample's tokens in order in the row
        if config.check_packing:
            for model in (self._model, self._ref, *self._teachers.values()):
                if model is not None:
                    check_packing_isolation(model.eval(), self._device, share_prompts=self._share_prompts)
        for model in (self._model, self._ref, *self._teachers.values()):
            if model is not None and config.fused_output_head:
                fuse_output_head(model)
        if config.gradient_checkpointing:
            hf_models.enable_activation_checkpointing(self._model)
        frozen_params.freeze_by_name(self._model, config.only_train_params_name_list, config.freeze_params_name_list)
        self._param_names, groups = param_groups(self._model, config.weight_decay)
        if self._mtp is not None:  # the MTP layers train with the policy's optimizer settings
            names, more = param_groups(self._mtp.module, config.weight_decay, prefix="mtp.")
            self._param_names, groups = self._param_names + names, groups + more
        self._optimizer = build_adam(groups, lr=config.lr, betas=config.betas, eps=config.eps,
                                     weight_decay=config.weight_decay, stateless=config.stateless_adam,
                                     fused=self._device.type == "cuda")
        self._context: ContextParallel | None = None  # the ranks this one splits each row with
        self._parallel = DataParallel(rank=_rank(), size=_world_size(), group=None)  # those with other samples
        if config.context_parallel_size > 1:
            self._context, self._parallel = ContextParallel.split_world(config.context_parallel_size, self._device)
        self._train_module: nn.Module = self._model
        if _world_size() > 1:
            self._train_module = summing_ddp(self._model, self._device)
        self._counter = VersionCounter()
        router_settings = RouterLossSettings(config.moe_aux_loss_coeff, config.moe_z_loss_coeff)
        self._routers = (Routers(self._model, wanted_by="--moe-aux-loss-coeff/--moe-z-loss-coeff/"
                                 "--use-routing-replay")
                         if router_settings.active or config.use_routing_replay or router_modules(self._model)
                         else None)
        self._checkpoint_layout: layouts.CheckpointLayout | None = None  # `named_tensors("checkpoint")`
        self._record_routes = config.use_routing_replay
        self._router_losses = (RouterLosses(self._routers, router_settings,
                                            row_group=None if self._context is None else self._context.group)
                               if self._routers is not None and router_settings.active else None)
        self._critic = None
        if config.critic is not None:
            self._critic = ValueCritic(
                hf_models.load_model(config.critic.model_path, self._device, config.attn_implementation),
                config.critic,
                device=self._device, plan=self._plan, share_prompts=self._share_prompts, autocast=self._autocast,
                world_size=_world_size(), betas=config.betas, eps=config.eps, weight_decay=config.weight_decay,
                grad_clip=config.grad_clip, split=self._split, stats_group=self._parallel.group)

    # -- Trainer ---------------------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._counter.version

    def compute_log_probs(
        self,
        samples: Sequence[TrainSample],
        *,
        temperature: float,
        with_entropy: bool = False,
        model: ModelRole = "policy",
    ) -> ModelOutputs:
        """Packed in sample order, returned on the CPU (where samples live), computed without gradients."""
        if model == "ref" and self._ref_is_base:
            network, adapter_off = self._model, self._model.disable_adapter()
        else:
            network = select_model(model, self._model, self._ref, self._teachers)
            adapter_off = contextlib.nullcontext()
        validate_samples(samples)
        if not samples:
            empty = torch.empty(0)
            return ModelOutputs(log_probs=empty, entropy=empty if with_entropy else None)
        network.eval()
        per_sample: list[ModelOutputs | None] = [None] * len(samples)
        record = self._record_routes and model == "policy"
        recorded: list[Tensor | None] = [None] * len(samples)
        with torch.no_grad(), self._autocast(), adapter_off:
            for members in self._plan(samples):
                chunk = [samples[index] for index in members]
                inputs = self._pack(chunk, with_token_positions=record or carries_routes(chunk))
                whole, inputs = inputs, self._split(inputs)
                replayed = self._replayed(chunk, whole, inputs) if model == "policy" else contextlib.nullcontext()
                tapped = self._routers.tapped() if record and self._routers is not None else contextlib.nullcontext()
                with replayed, tapped as layers:
                    outputs = token_outputs(network, inputs, head_of=network, temperature=temperature,
                                            with_entropy=with_entropy)
                if record:
                    if inputs.context_row is not None:  # each rank recorded its rows: the whole row's, per sample
                        layers = [RoutedLayer(layer.logits, inputs.context_row.join_rows(layer.chosen))
                                  for layer in layers]
                    for index, routes in zip(members, sample_routes(layers, chunk, whole), strict=True):
                        recorded[index] = routes
                lengths = inputs.response_lengths.tolist()
                log_probs = outputs.log_probs.cpu().split(lengths)
                entropy = outputs.entropy.cpu().split(lengths) if outputs.entropy is not None else [None] * len(chunk)
                for index, lp, ent in zip(members, log_probs, entropy, strict=True):
                    per_sample[index] = ModelOutputs(lp, ent)
        return ModelOutputs(
            log_probs=torch.cat([out.log_probs for out in per_sample]),
            entropy=torch.cat([out.entropy for out in per_sample]) if with_entropy else None,
            routed_experts=[routes for routes in recorded if routes is not None] if record else None,
        )

    def train_step(
        self,
        samples: Sequence[TrainSample],
        loss: Loss,
        *,
        temperature: float,
        with_entropy: bool = False,
        ends_batch: bool = True,
    ) -> StepResult:
        started = time.perf_counter()
        validate_samples(samples)
        plan = self._plan(samples)
        counts = self._step_counts(samples, len(plan))
        self._model.train()
        self._optimizer.zero_grad(set_to_none=True)
        self._move_optimizer_state(self._device)
        stats = StepStats()
        for position, members in enumerate(plan):
            chunk = [samples[index] for index in members]
            inputs = self._pack(chunk, with_token_positions=carries_routes(chunk))
            whole, inputs = inputs, self._split(inputs)
            replayed = self._replayed(chunk, whole, inputs)
            batch = collate(chunk, self._device)
            synchronise = position == len(plan) - 1
            with self._gradient_sync(synchronise):
                captured = self._mtp.capturing() if self._mtp is not None else contextlib.nullcontext()
                with self._autocast(), replayed, self._routed() as routed, captured:
                    outputs = token_outputs(self._train_module, inputs, head_of=self._model,
                                            temperature=temperature, with_entropy=with_entropy)
                    value, metrics = loss(outputs, batch)
                    if self._router_losses is not None:
                        router_loss, router_metrics = self._router_losses.loss(routed, counts[2])
                        value, metrics = value + router_loss, {**metrics, **router_metrics}
                    if self._mtp is not None:
                        mtp_loss, mtp_metrics = self._mtp.loss(inputs, batch.loss_mask, counts[0])
                        value, metrics = value + mtp_loss, {**metrics, **mtp_metrics}
                check_loss(value)
                # Backward even on a non-finite loss: the other ranks' gradient all-reduce waits for ours.
                value.backward()
            stats.add(value, metrics)
        if self._mtp is not None and self._parallel.size > 1:
            self._mtp.sum_gradients(self._parallel.group)
        loss_sum, nonfinite_loss, metric_sums = self._reduce_step_stats(stats)
        return self._apply_update(loss_sum, nonfinite_loss, metric_sums, counts, len(plan), started, ends_batch)

    def mtp_agreement(self, samples: Sequence[TrainSample]) -> list[float]:
        """Per MTP depth, how often its top-1 guess is the samples' own next-but-k token (`engines.training.mtp`)."""
        if self._mtp is None:
            raise ValueError("this trainer trains no MTP layers (TorchTrainerConfig.mtp)")
        self._model.eval()
        with self._autocast():
            return self._mtp.top1_agreement(self._model, (self._pack([sample], with_token_positions=False)
                                                          for sample in samples))

    def reset_optimizer_state(self) -> None:
        """AdamW makes a parameter's state afresh (step 0, zero moments) at its next step when it has none."""
        self._optimizer.state.clear()
        if self._critic is not None:
            self._critic.reset_optimizer_state()

    def refresh_reference(self) -> None:
        if self._ref is None:
            raise ValueError("--ref-update-interval: this trainer holds no separate reference model to refresh (with "
                             "LoRA the reference is the policy with its adapter off)")
        reference.copy_policy_into(self._model, self._ref)

    def _routed(self) -> contextlib.AbstractContextManager[list[RoutedLayer]]:
        """Records the routers' outputs of the forward inside it, when the run has router losses."""
        return self._routers.tapped() if self._router_losses is not None else contextlib.nullcontext([])

    def _replayed(self, chunk: Sequence[TrainSample], inputs: PackedInputs,
                  held: PackedInputs) -> contextlib.AbstractContextManager:
        """A policy forward of `chunk` inside it routes as the samples' `routed_experts` say, where they carry
        them (the reference and teachers route for themselves, as slime's replay leaves them). `inputs` is the
        whole row, `held` what this rank runs of it (the same, unless the row is split across ranks)."""
        if not carries_routes(chunk):
            return contextlib.nullcontext()
        if self._routers is None:
            raise ValueError(f"routing replay: {type(self._model).__name__} has no MoE router, but the samples "
                             "carry routed_experts")
        replay = row_routes(chunk, inputs)
        assert replay is not None
        if held.context_row is not None:  # the routes of the rows this rank holds
            rows = held.context_row.rows
            replay = (replay[0][rows], replay[1][rows])
        return self._routers.replaying(*replay)

    def _pack(self, chunk: Sequence[TrainSample], *, with_token_positions: bool) -> PackedInputs:
        """One micro-batch's row on the device, a vision-language model's with its images and 3-D positions."""
        inputs = pack_inputs(chunk, share_prompts=self._share_prompts and vision.sharing_allowed(chunk),
                             with_token_positions=with_token_positions)
        return vision.with_rope_positions(self._model, inputs, chunk).to(self._device)

    def _split(self, inputs: PackedInputs) -> PackedInputs:
        """This rank's part of the row under context parallelism; the whole row otherwise."""
        return inputs if self._context is None else self._context.split_row(inputs)

    @property
    def has_critic(self) -> bool:
        return self._critic is not None

    @property
    def critic_steps(self) -> int:
        return 0 if self._critic is None else self._critic.calls

    def compute_values(self, samples: Sequence[TrainSample]) -> Tensor:
        validate_samples(samples)
        return self._critic_or_raise().values(samples)

    def train_critic(self, samples: Sequence[TrainSample], loss: ValueLossFn) -> StepResult:
        validate_samples(samples)
        return self._critic_or_raise().train_step(samples, loss, version=self._counter.version)

    def _critic_or_raise(self) -> ValueCritic:
        if self._critic is None:
            raise ValueError("this trainer holds no critic (TorchTrainerConfig.critic)")
        return self._critic

    def save_checkpoint(self, directory: str | Path, extra_state: dict[str, Any]) -> None:
        """Rank 0 writes (all ranks hold identical weights and moments); every rank returns or raises together."""
        checkpoint.check_json(extra_state)

        def write() -> None:
            with checkpoint.atomic_directory(directory) as staging:
                if self.config.lora is not None:  # the base weights are the model path's: the adapter suffices
                    save_file(self._trainable_weights(), str(staging / checkpoint.WEIGHTS_FILE))
                else:
                    save_model(self._model, str(staging / checkpoint.WEIGHTS_FILE))
                if self._mtp is not None:
                    save_file(self._mtp.state_dict(), str(staging / mtp.WEIGHTS_FILE))
                optimizer_meta = checkpoint.save_optimizer(
                    staging / checkpoint.OPTIMIZER_FILE, self._optimizer, self._param_names, self.config.save_optimizer
                )
                if self._critic is not None:
                    self._critic.save(staging / CRITIC_DIRECTORY, keep_optimizer=self.config.save_optimizer)
                checkpoint.write_state(
                    staging,
                    {
                        **self._counter.state(),
                        "optimizer": optimizer_meta,
                        "config": self.config.model_dump(mode="json"),
                        "extra_state": extra_state,
                    },
                )

        self._on_rank_zero(write, f"saving checkpoint {directory}")

    def load_checkpoint(self, directory: str | Path) -> dict[str, Any]:
        directory = Path(directory)
        state = checkpoint.read_state(directory)
        weights = directory / checkpoint.WEIGHTS_FILE
        if not weights.is_file():
            raise FileNotFoundError(f"{directory}: checkpoint has no {checkpoint.WEIGHTS_FILE}")
        if self.config.lora is not None:
            self._load_adapter(weights, state.get("config", {}).get("lora"))
        else:
            missing, unexpected = load_model(self._model, str(weights), strict=False, device=str(self._device))
            if missing or unexpected:
                raise ValueError(
                    f"{weights}: weights do not match this model (missing {missing[:5]}, unexpected "
                    f"{unexpected[:5]})"
                )
        if self._mtp is not None:
            if not (directory / mtp.WEIGHTS_FILE).is_file():
                raise FileNotFoundError(f"{directory}: checkpoint has no {mtp.WEIGHTS_FILE}; it was saved by a run "
                                        "without --enable-mtp-training (resume from an HF export of it instead)")
            self._mtp.load_state_dict(load_file(str(directory / mtp.WEIGHTS_FILE), device=str(self._device)))
        checkpoint.load_optimizer(
            directory / checkpoint.OPTIMIZER_FILE, self._optimizer, self._param_names, state["optimizer"]
        )
        if self._critic is not None:
            self._critic.load(directory / CRITIC_DIRECTORY)
        self._counter.restore(state)
        return state["extra_state"]

    def named_tensors(self, layout: WeightLayout = "model") -> Iterator[tuple[str, Tensor]]:
        """The float32 master weights, not copies: send them before the next step changes them.

        Tied weights appear once (under the first name, as `named_parameters` lists them); a receiving HF model
        ties the alias itself. Cast to the engine's dtype on the way (the weight sender does it per bucket).
        A LoRA run sends its adapter alone, under the names `engines.training.lora` gives it; a frozen vision tower
        is not sent (`engines.training.vision`). In the checkpoint
        layout a stacked layer of experts goes out one expert projection at a time, each a view of its stack.
        """
        if self.config.lora is not None:
            yield from lora.adapter_tensors(self._model)
            return
        weights = vision.pushed(((name, parameter.detach()) for name, parameter in self._model.named_parameters()),
                                tower_trains=not self.config.freeze_vision_tower)
        if layout == "checkpoint" and layouts.renamed_in_checkpoint(self._model):
            if self._checkpoint_layout is None:  # a meta skeleton of the model: built once, not at every push
                self._checkpoint_layout = layouts.CheckpointLayout(self._model.config)
            weights = self._checkpoint_layout(weights)
        yield from weights

    def export_hf(self, directory: str | Path) -> None:
        def write() -> None:
            with checkpoint.atomic_directory(directory) as staging:
                checkpoint.copy_auxiliary_files(Path(self.config.model_path), staging)
                if self.config.lora is None:
                    self._model.save_pretrained(staging)
                    if self._mtp is not None:
                        self._mtp.export(staging)
                else:  # the merged policy, loadable as any HF model, and the adapter beside it
                    lora.save_merged(self._model, staging)
                    lora.save_adapter(self._model, staging / "adapter")

        self._on_rank_zero(write, f"exporting {directory}")

    def data_parallel(self) -> DataParallel:
        return self._parallel

    @property
    def gates_updates(self) -> bool:
        """One process: only the optimizer writes the weights, and grad mode and autocast are per thread."""
        return _world_size() == 1

    @property
    def prepares_beside_training(self) -> bool:
        """One process: the reference model is its own module, and grad mode and autocast are per thread. Not
        when the reference is the policy with its adapter off: switching it off would change the training pass."""
        return _world_size() == 1 and not self._ref_is_base

    def close(self) -> None:
        """Drop the DDP wrapper while the process group is still alive; call before destroy_process_group().

        A DDP reducer that outlives the group's other references destroys the group itself, from Python's
        garbage collector, with the GIL held, while gloo's worker threads wait for the GIL to release tensors:
        the process then hangs at exit. Releasing the reducer first leaves the group's destruction to
        torch.distributed, which drops the GIL for it.
        """
        if isinstance(self._train_module, DistributedDataParallel):
            self._train_module = self._model
            gc.collect()

    def _move_optimizer_state(self, device: torch.device) -> None:
        """The AdamW moments to `device` (a no-op where they are already); see `offload_optimizer`."""
        if not self.config.offload_optimizer or self._device.type == "cpu":
            return
        for state in self._optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, Tensor) and value.device != device and value.dim() > 0:
                    state[key] = value.to(device, non_blocking=device.type == "cpu")
        if device.type == "cpu":
            torch.cuda.synchronize(self._device)  # the copies are complete before the device memory is reused
            torch.cuda.empty_cache()  # and it goes back to the device, for the engines that generate next

    # -- LoRA -------------------------------------------------------------------------------------------------

    def _trainable_weights(self) -> dict[str, Tensor]:
        return {name: parameter.detach().cpu().contiguous()
                for name, parameter in self._model.named_parameters() if parameter.requires_grad}

    def _load_adapter(self, weights: Path, saved_settings: dict[str, Any] | None) -> None:
        """The adapter of a LoRA checkpoint of the same shape; anything else is refused by what differs."""
        assert self.config.lora is not None
        current = self.config.lora.model_dump(mode="json")
        if saved_settings is None:
            raise ValueError(f"{weights}: a full-weight checkpoint; this run trains a LoRA adapter (--lora-rank "
                             f"{self.config.lora.rank})")
        if saved_settings != current:
            raise ValueError(f"{weights}: adapter settings {saved_settings} differ from this run's {current}")
        saved = load_file(str(weights), device=str(self._device))
        parameters = {name: p for name, p in self._model.named_parameters() if p.requires_grad}
        if saved.keys() != parameters.keys():
            missing, unexpected = sorted(parameters.keys() - saved.keys()), sorted(saved.keys() - parameters.keys())
            raise ValueError(f"{weights}: adapter does not match this model (missing {missing[:5]}, unexpected "
                             f"{unexpected[:5]})")
        with torch.no_grad():
            for name, parameter in parameters.items():
                parameter.copy_(saved[name])

    # -- step internals ---------------------------------------------------------------------------------------

    def _apply_update(
        self,
        loss_sum: float,
        nonfinite_loss: bool,
        metric_sums: dict[str, float],
        counts: tuple[int, int],
        micro_batches: int,
        started: float,
        ends_batch: bool,
    ) -> StepResult:
        """Clip, then step unless something is non-finite. The decision is identical on every rank: the loss
        flag was all-reduced and the gradient norm is computed from already-summed gradients."""
        max_norm = self.config.grad_clip if self.config.grad_clip is not None else float("inf")
        trained = [*self._model.parameters(), *(self._mtp.module.parameters() if self._mtp is not None else ())]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(trained, max_norm))
        lr = scheduled_lr(self.config, self._counter.optimizer_steps)
        reason = skip_reason(nonfinite_loss, loss_sum, grad_norm, loss_tokens=counts[0])
        if reason is None:
            if self.update_gate is not None:
                self.update_gate()  # the previous version's push has read the weights this step overwrites
            for group in self._optimizer.param_groups:
                group["lr"] = lr
            self._optimizer.step()
        self._counter.after_step(applied=reason is None, ends_batch=ends_batch)
        self._optimizer.zero_grad(set_to_none=True)
        if self.config.offload_optimizer:
            self._move_optimizer_state(torch.device("cpu"))
        return step_result(self._counter.version, metric_sums, loss=loss_sum, lr=lr, grad_norm=grad_norm,
                           loss_tokens=counts[0], sequences=counts[1], micro_batches=micro_batches,
                           started=started, skip_reason=reason)

    def _step_counts(self, samples: Sequence[TrainSample], micro_batches: int) -> tuple[int, int, int]:
        """The step's (loss tokens, sequences, micro-batches) over every data-parallel rank; all-reduced once, so an
        empty shard on any rank fails every rank alike instead of leaving the others in a collective (no hang)."""
        counts = torch.tensor([count_loss_tokens(samples), len(samples), micro_batches, int(not samples)],
                              dtype=torch.int64)
        if self._parallel.size > 1:  # a context-parallel group's ranks hold the same samples: counted once
            counts = counts.to(self._device)
            dist.all_reduce(counts, group=self._parallel.group)
            counts = counts.cpu()
        loss_tokens, sequences, micro_batches, empty_ranks = counts.tolist()
        if empty_ranks:
            raise ValueError(f"train_step: {empty_ranks} data-parallel rank(s) got no samples; every rank needs some")
        return loss_tokens, sequences, micro_batches

    def _reduce_step_stats(self, stats: StepStats) -> tuple[float, bool, dict[str, float]]:
        """Every rank runs every metric's loss terms, so the keys agree and one all-reduce sums them (over the
        data-parallel ranks: a context-parallel group computes its micro-batches' loss once per rank)."""
        if self._parallel.size == 1:
            return stats.loss_sum, stats.nonfinite, stats.metric_sums
        keys = sorted(stats.metric_sums)
        values = [stats.loss_sum, float(stats.nonfinite), *(stats.metric_sums[key] for key in keys)]
        stats = torch.tensor(values, dtype=torch.float64, device=self._device)
        dist.all_reduce(stats, group=self._parallel.group)
        reduced = stats.cpu().tolist()
        return reduced[0], reduced[1] > 0, dict(zip(keys, reduced[2:], strict=True))

    def _on_rank_zero(self, write: Callable[[], None], what: str) -> None:
        """Run `write` on rank 0 only, then agree on the outcome, so a failure there (disk full) raises on every
        rank instead of leaving the others waiting at a barrier."""
        failure: BaseException | None = None
        if _rank() == 0:
            try:
                write()
            except Exception as error:  # re-raised below, after the other ranks heard about it
                failure = error
        if _world_size() > 1:
            failed = torch.tensor([int(failure is not None)], device=self._device)
            dist.all_reduce(failed)
            if failed.item() and failure is None:
                raise RuntimeError(f"{what} failed on rank 0")
        if failure is not None:
            raise failure

    def _plan(self, samples: Sequence[TrainSample]) -> list[list[int]]:
        if self._share_prompts and vision.sharing_allowed(samples):
            return plan_shared_micro_batches(samples, self.config.micro_batch_tokens)
        return plan_micro_batches([int(s.tokens.numel()) for s in samples], self.config.micro_batch_tokens)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        dtype = self.config.compute_dtype
        if dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self._device.type, dtype=dtype)

    def _gradient_sync(self, synchronise: bool) -> contextlib.AbstractContextManager[Any]:
        if synchronise or not isinstance(self._train_module, DistributedDataParallel):
            return contextlib.nullcontext()
        return self._train_module.no_sync()


# -- helpers -------------------------------------------------------------------------------------------------


def _resolve_device(name: str) -> torch.device:
    if name == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(name)


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
