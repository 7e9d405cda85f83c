"""The Megatron-core trainer: a GPT model built from an HF checkpoint, split over TP x PP x DP ranks.

Calls. Every method is collective over all learner ranks, and every rank passes the SAME, whole batch: the
trainer takes its data-parallel shard itself (`engines.megatron.batches`). Results are identical on every rank
(log-probs of the whole batch, the step's metrics), so the caller never needs to know the parallel layout.

Step. One megatron pipeline schedule per step runs this rank's micro-batches (packed rows, see `batches`);
the loss of each micro-batch is the `Loss` object built in `policies/`, already normalised by the step's global
counts (its denominators come from the whole batch, which every rank holds). So gradients must be SUMMED over
micro-batches and DP ranks: `calculate_per_token_loss` stops the schedule from dividing by the micro-batch
count and megatron's DDP from averaging over DP, and our `finalize_model_grads` wrapper drops the token-count
rescaling that flag would otherwise apply. The optimizer step is megatron's own (distributed optimizer
optional), split open so that a non-finite loss or gradient norm skips the update like the torch trainer does.

Devices. The model lives where megatron puts it (`parallel.compute_device()`: the current GPU, else the CPU);
every micro-batch tensor is built on the model's device (`batches`), every tensor of our own collectives on the
device the default group's backend carries (`collectives`), and the world this trainer creates when there is
none is NCCL on CUDA, gloo on the CPU (`parallel`). Results handed back (log-probs) are on the CPU.

CPU. Without CUDA every call into megatron runs inside `cpu_compat()` (see that module); with CUDA it is never
entered.

Precision. `dtype="bfloat16"` builds the model in bf16 inside megatron's `Float16Module` with float32 master
weights in megatron's optimizer (`OptimizerConfig(bf16=True)`), as megatron's own training does; `named_tensors()`
then yields the bf16 model weights the inference engines serve.

Hooks. slime's --custom-megatron-before-log-prob-hook-path and --custom-megatron-before-train-step-hook-path run
at slime's call points: once per log-prob pass, once per optimizer step before its first forward (`hooks`).

Frozen models. The reference (`ref_model_path`) and each distillation teacher (`teacher_model_paths`, slime's
--opd-type megatron) are GPT models built from their HF folders through the bridge at the policy's TP x PP layout,
without gradients or optimizer state; `compute_log_probs(model="ref" | teacher_role(name))` runs them as it runs the
policy. Checkpoints hold the policy only: the frozen models are rebuilt from their folders.

Checkpoints are megatron distributed checkpoints (resharding: save at one TP/PP/DP layout, load at another) plus
`trainer_state.json` (version, extra state), written to a staging directory and renamed into place.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import Tensor, nn
from transformers import AutoConfig

from engines import frozen_params
from engines.megatron import collectives, optimizer, parallel
from engines.megatron.batches import (
    MicroBatch,
    filler_micro_batch,
    micro_batch_counts,
    plan_micro_batches,
    shard_for_rank,
)
from engines.megatron.bridge import HFBridge
from engines.megatron.config import MegatronTrainerConfig
from engines.megatron.cpu_compat import maybe_cpu_compat
from engines.megatron.experts import (
    MOE_FAMILIES,
    RouteRecorder,
    RouterLossScale,
    RoutingReplay,
    checkpoint_expert_parallel_problem,
)
from engines.megatron.hooks import StepHooks
from engines.megatron.logprobs import vocab_parallel_log_probs
from engines.training import base, checkpoint, reference
from engines.training.base import Loss, ModelOutputs, ModelRole, StepResult, Trainer, TrainSample
from engines.training.micro_batches import count_loss_tokens

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_HF_CONFIG_FILES = ("config.json", "generation_config.json")
# Optimizer state stored per parameter in model space, so a checkpoint loads at any TP/PP/DP layout.
_CHECKPOINT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
OPTIMIZER_SAVED = "optimizer_saved"  # trainer-state key: False for a checkpoint written without the optimizer


class MegatronTrainer(Trainer):
    """See the module docstring. Construct on every learner rank (torch.distributed initialised or not)."""

    def __init__(self, config: MegatronTrainerConfig) -> None:
        self.config = config
        if config.use_routing_replay:  # before any process group exists
            model_type = AutoConfig.from_pretrained(config.model_path).model_type
            if model_type not in MOE_FAMILIES:
                raise ValueError(f"--use-routing-replay: {model_type} has no MoE router (a dense model); drop the "
                                 "flag")
        self._hooks = StepHooks(config.model_flags)  # slime's per-step hooks: a bad path fails before any build
        self._owns_world = parallel.ensure_default_group(parallel.compute_device())
        self._counter = base.VersionCounter()
        with maybe_cpu_compat():
            parallel.initialize_model_parallel(
                config.tensor_model_parallel_size, config.pipeline_model_parallel_size, config.seed,
                expert_parallel=config.expert_model_parallel_size,
                expert_tensor_parallel=config.expert_tensor_parallel_size,
            )
            dtype = _DTYPES[config.dtype]
            self._bridge = HFBridge(config.model_path, dtype=dtype, flags=config.model_flags)
            stage = self._bridge.build_stage()
            self._bridge.load_hf_weights([stage])
            self._stage = stage
            # slime freezes in its model provider, before DDP and the optimizer see the parameters: so do we
            frozen_params.freeze_by_name(stage, config.only_train_params_name_list,
                                         config.freeze_params_name_list, gather=collectives.gather_objects)
            self._router_losses = RouterLossScale(stage, self._bridge.transformer_config)
            self._routing_replay = RoutingReplay(stage)
            self._device = next(stage.parameters()).device
            self._module = _wrap_ddp(_maybe_float16(stage, self._bridge.transformer_config), config)
            self._optimizer = optimizer.build(config, self._module)
            transformer_config = self._bridge.transformer_config
            transformer_config.finalize_model_grads_func = _finalize_summed_grads
            transformer_config.no_sync_func = self._module.no_sync
            self._ref: nn.Module | None = None
            self._ref_stage: nn.Module | None = None  # the reference's GPTModel (inside Float16Module under bf16)
            if config.ref_model_path is not None:
                self._ref, self._ref_stage = self._build_frozen(config.ref_model_path, dtype)
            # Distillation teachers (slime's --opd-type megatron): frozen like the reference and split like it, each
            # from its own HF folder (its own shape: a larger teacher of the same tokenizer).
            self._teachers = {name: self._build_teacher(name, path, dtype)
                              for name, path in config.teacher_model_paths.items()}
            if config.initial_checkpoint is not None:
                self._load_weights_from(Path(config.initial_checkpoint))

    # -- Trainer ---------------------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._counter.version

    def compute_log_probs(self, samples: Sequence[TrainSample], *, temperature: float, with_entropy: bool = False,
                          model: ModelRole = "policy") -> ModelOutputs:
        """The whole batch's log-probs on every rank, packed in sample order, on the CPU, without gradients.

        Gathered on the model's device and summed over the world on the collective device (one copy to the CPU
        at the end), so NCCL never sees a CPU tensor."""
        network = base.select_model(model, self._module, self._ref, self._teachers)
        base.validate_samples(samples)
        offsets = _response_offsets(samples)
        log_probs = torch.zeros(offsets[-1], dtype=torch.float32, device=self._device)
        entropy = torch.zeros(offsets[-1], dtype=torch.float32, device=self._device) if with_entropy else None

        def collect(micro_batch: MicroBatch, outputs: ModelOutputs) -> Tensor:
            lengths = list(micro_batch.response_lengths)
            for index, values in zip(micro_batch.members, outputs.log_probs.split(lengths), strict=True):
                log_probs[offsets[index] : offsets[index + 1]] = values.float()
            if entropy is not None and outputs.entropy is not None:
                for index, values in zip(micro_batch.members, outputs.entropy.split(lengths), strict=True):
                    entropy[offsets[index] : offsets[index + 1]] = values.float()
            return outputs.log_probs.sum() * 0.0

        recorder = self._route_recorder(samples) if self.config.use_routing_replay and model == "policy" else None
        with maybe_cpu_compat(), torch.no_grad():
            network.eval()
            self._hooks.before_log_prob([network], model)
            if samples:
                micro_batches = self._micro_batches(samples, with_batch=False)
                with self._routing_replay.recording() if recorder is not None else contextlib.nullcontext():
                    self._run_schedule(network, micro_batches, collect, temperature, with_entropy,
                                       forward_only=True, recorder=recorder)
            # Exactly one rank (last stage, TP rank 0) wrote each position; a sum over the world spreads them.
            if not (parallel.is_last_stage() and parallel.tp_rank() == 0):
                log_probs.zero_()
                if entropy is not None:
                    entropy.zero_()
            log_probs = collectives.sum_over_world(log_probs).cpu()
            entropy = None if entropy is None else collectives.sum_over_world(entropy).cpu()
            routed = None if recorder is None else recorder.finish()
        return ModelOutputs(log_probs=log_probs, entropy=entropy, routed_experts=routed)

    def _route_recorder(self, samples: Sequence[TrainSample]) -> RouteRecorder:
        config = self._bridge.transformer_config
        return RouteRecorder(samples, config.num_layers, config.moe_router_topk, self._device,
                             tensor_parallel=parallel.tp_size(), tp_rank=parallel.tp_rank(),
                             sequence_parallel=self._bridge.sequence_parallel)

    def train_step(self, samples: Sequence[TrainSample], loss: Loss, *, temperature: float, with_entropy: bool = False,
                   ends_batch: bool = True) -> StepResult:
        started = time.perf_counter()
        base.validate_samples(samples)
        if not samples:
            raise ValueError("train_step: no samples")
        counts = (count_loss_tokens(samples), len(samples))  # the whole batch: every rank holds it
        stats = _StepStats()

        def loss_of(micro_batch: MicroBatch, outputs: ModelOutputs) -> Tensor:
            assert micro_batch.batch is not None
            value, metrics = loss(outputs, micro_batch.batch)
            base.check_loss(value)
            stats.add(value, metrics)
            return value

        with maybe_cpu_compat():
            self._module.train()
            self._module.zero_grad_buffer()
            self._optimizer.zero_grad()
            self._hooks.before_train_step([self._module], self._optimizer)
            micro_batches = self._micro_batches(samples, with_batch=True)
            step_micro_batches = self._step_micro_batches(samples)
            if self._router_losses.active:
                self._router_losses.for_step(step_micro_batches)
            self._run_schedule(self._module, micro_batches, loss_of, temperature, with_entropy, forward_only=False)
            reduced = stats.reduce(contributes=parallel.is_last_stage() and parallel.tp_rank() == 0)
            if self._router_losses.active:
                router = self._router_losses.metrics(step_micro_batches, tensor_parallel=parallel.tp_size())
                reduced = (reduced[0] + self._router_losses.loss_term(router), reduced[1], {**reduced[2], **router})
            result = self._apply_update(reduced, counts, len(micro_batches), started, ends_batch)
        self._hooks.after_train_step(ends_batch=ends_batch)
        return result

    def save_checkpoint(self, directory: str | Path, extra_state: dict[str, Any]) -> None:
        """Every rank writes its shards into one staging directory; rank 0 adds the state file and renames."""
        checkpoint.check_json(extra_state)
        state = {
            **self._counter.state(),
            **self._hooks.state(),
            "config": self.config.model_dump(mode="json"),
            "format": "megatron-dist",
            "extra_state": extra_state,
        }
        with maybe_cpu_compat():
            collectives.on_all_ranks_atomically(Path(directory), lambda staging: self._save_into(staging, state))

    def save_model_only(self, directory: str | Path, extra_state: dict[str, Any]) -> None:
        """Weights only, as a distributed checkpoint that `initial_checkpoint` (or another layout) loads."""
        from megatron.core import dist_checkpointing

        checkpoint.check_json(extra_state)
        state = {**self._counter.state(), "format": "megatron-dist-model", "extra_state": extra_state}

        def write(staging: Path) -> None:
            dist_checkpointing.save({"model": self._stage.sharded_state_dict()}, str(staging))
            if dist.get_rank() == 0:
                checkpoint.write_state(staging, state)

        with maybe_cpu_compat():
            collectives.on_all_ranks_atomically(Path(directory), write)

    def load_checkpoint(self, directory: str | Path) -> dict[str, Any]:
        directory = Path(directory)
        state = checkpoint.read_state(directory)
        saved_expert_parallel = int(state.get("config", {}).get("expert_model_parallel_size", 1))
        problem = self._router_losses.moe and checkpoint_expert_parallel_problem(
            saved_expert_parallel, self.config.expert_model_parallel_size)
        if problem:
            raise ValueError(f"{directory}: {problem}")
        from megatron.core import dist_checkpointing

        with_optimizer = state.get(OPTIMIZER_SAVED, True)  # a --no-save-optim checkpoint: a fresh optimizer
        with maybe_cpu_compat():
            model_state = self._stage.sharded_state_dict(metadata=_CHECKPOINT_METADATA)
            sharded = {"model": model_state}
            if with_optimizer:
                optimizer.prime(self._optimizer)
                sharded["optimizer"] = self._optimizer.sharded_state_dict(
                    model_state, is_loading=True, metadata=_CHECKPOINT_METADATA)
            loaded = dist_checkpointing.load(sharded, str(directory))
            self._stage.load_state_dict(loaded["model"])
            if with_optimizer:
                with optimizer.step_tolerant_loading(self._optimizer):
                    self._optimizer.load_state_dict(loaded["optimizer"])
                optimizer.after_load(self._optimizer)
        self._counter.restore(state)
        self._hooks.restore(state)
        return state["extra_state"]

    def named_tensors(self, layout: base.WeightLayout = "model") -> Iterator[tuple[str, Tensor]]:
        """The HF model's names and layouts in memory (the torch trainer's; a MoE layer's experts stacked), TP
        shards gathered and PP stages broadcast. COLLECTIVE: every learner rank must iterate it to the end (every
        rank receives every tensor; the weight sender uses rank 0's). In the checkpoint layout each expert
        projection leaves as mbridge gathers it from its expert-parallel rank: one at a time, never a whole layer
        of experts at once."""
        if layout == "checkpoint":
            return self._each_in_compat(self._bridge.export_hf_weights([self._stage]))
        return self._each_in_compat(self._bridge.model_layout_weights([self._stage]))

    def _each_in_compat(self, inner: Iterator[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        while True:
            with maybe_cpu_compat():
                item = next(inner, None)
            if item is None:
                return
            yield item

    def export_hf(self, directory: str | Path) -> None:
        """A Hugging Face folder in the checkpoint layout (experts apart, as `save_pretrained` writes them)."""
        tensors = {name: tensor.detach().cpu().contiguous().clone()
                   for name, tensor in self._each_in_compat(self._bridge.export_hf_weights([self._stage]))}
        source = Path(self.config.model_path)

        def write() -> None:
            with checkpoint.atomic_directory(directory) as staging:
                checkpoint.copy_auxiliary_files(source, staging)
                for name in _HF_CONFIG_FILES:
                    if (source / name).is_file():
                        shutil.copy2(source / name, staging / name)
                save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})

        collectives.on_rank_zero(write, f"exporting {directory}")

    def reset_optimizer_state(self) -> None:
        """Zeroed in place, as slime does, so megatron's optimizer keeps the state entries its checkpoints expect."""
        optimizer.reset_state(self._optimizer)

    def refresh_reference(self) -> None:
        """This rank's part of the policy into its part of the reference: both are split alike (TP x PP)."""
        if self._ref_stage is None:
            raise ValueError("--ref-update-interval: this trainer holds no reference model (it needs a KL term)")
        reference.copy_policy_into(self._stage, self._ref_stage)

    def close(self) -> None:
        """Tear down megatron's groups (and the world, if this trainer created it)."""
        parallel.destroy_model_parallel()
        if self._owns_world and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_world = False

    # -- internals ---------------------------------------------------------------------------------------------

    def _micro_batches(self, samples: Sequence[TrainSample], *, with_batch: bool) -> list[MicroBatch]:
        """This rank's micro-batches; under expert parallelism topped up with fillers to the count of the busiest
        data-parallel rank (`batches.filler_micro_batch`), and at least a filler where the share is empty (fewer
        samples than data-parallel ranks: a step's gradient reduction needs every rank)."""
        rank, ranks = parallel.dp_rank_and_size()
        lengths = [int(s.tokens.numel()) for s in samples]
        members = shard_for_rank(lengths, ranks, rank)
        planned = plan_micro_batches(
            samples,
            members,
            self.config.micro_batch_tokens,
            qkv_format=self.config.qkv_format,
            with_batch=with_batch,
            device=self._device,
            pad_multiple=self._pad_multiple(),
        )
        filler = filler_micro_batch(self._pad_multiple(), qkv_format=self.config.qkv_format, device=self._device)
        if parallel.ep_size() == 1:
            return planned or [filler]
        busiest = max(micro_batch_counts(lengths, ranks, self.config.micro_batch_tokens,
                                         qkv_format=self.config.qkv_format, pad_multiple=self._pad_multiple()))
        return planned + [filler] * (busiest - len(planned))

    def _step_micro_batches(self, samples: Sequence[TrainSample]) -> int:
        """Micro-batches of this step over every data-parallel rank."""
        _, ranks = parallel.dp_rank_and_size()
        return sum(micro_batch_counts([int(s.tokens.numel()) for s in samples], ranks, self.config.micro_batch_tokens,
                                      qkv_format=self.config.qkv_format, pad_multiple=self._pad_multiple()))

    def _pad_multiple(self) -> int:
        return parallel.tp_size() if self._bridge.sequence_parallel else 1

    def _run_schedule(
        self,
        network: nn.Module,
        micro_batches: list[MicroBatch],
        on_outputs: Callable[[MicroBatch, ModelOutputs], Tensor],
        temperature: float,
        with_entropy: bool,
        *,
        forward_only: bool,
        recorder: RouteRecorder | None = None,
    ) -> None:
        """One megatron schedule (pipelined when PP > 1) over this rank's micro-batches; `recorder` takes each
        one's routes (inside `RoutingReplay.recording`)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        vocab_size = self._bridge.vocab_size
        one_token = torch.ones((), dtype=torch.int, device=self._device)  # per-token loss scaling is bypassed
        # bf16 (Float16Module): keep the logits in bf16 rather than upcasting the whole [B, S, V / TP] tensor;
        # `vocab_parallel_log_probs` upcasts the selected rows it reads, so the numbers are the same.
        model_kwargs = {"fp32_output": False} if self._bridge.transformer_config.bf16 else {}

        def loss_func(micro_batch: MicroBatch, logits: Tensor) -> tuple[Tensor, Tensor, dict[str, Any]]:
            if micro_batch.is_filler:
                return logits.sum() * 0.0, one_token, {}
            selected = logits[micro_batch.logit_rows, micro_batch.logit_columns]
            outputs = vocab_parallel_log_probs(
                selected,
                micro_batch.targets,
                temperature=temperature,
                with_entropy=with_entropy,
                vocab_size=vocab_size,
            )
            return on_outputs(micro_batch, outputs), one_token, {}

        policy = network is self._module  # the reference model routes for itself, as slime's replay leaves it

        def forward_step(data: Iterator[MicroBatch], model: nn.Module) -> tuple[Tensor, Callable[..., Any]]:
            micro_batch = next(data)
            packing = {"packed_seq_params": micro_batch.packed_seq_params} if micro_batch.packed_seq_params else {}
            replay = self._routing_replay.routing(
                micro_batch.routes if policy else None, micro_batch.replayed, tensor_parallel=parallel.tp_size(),
                rank=parallel.tp_rank(), sequence_parallel=self._bridge.sequence_parallel)
            with self._router_losses.silenced(micro_batch.is_filler), replay:
                output = model(micro_batch.input_ids, micro_batch.position_ids, None, **packing, **model_kwargs)
            if recorder is not None and not micro_batch.is_filler:
                recorder.record(micro_batch.members, micro_batch.token_starts, tuple(micro_batch.input_ids.shape),
                                self._routing_replay.chosen())
            return output, functools.partial(loss_func, micro_batch)

        if not micro_batches:
            return
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=[network],
            num_microbatches=len(micro_batches),
            seq_length=max(mb.input_ids.shape[1] for mb in micro_batches),
            micro_batch_size=max(mb.input_ids.shape[0] for mb in micro_batches),
            forward_only=forward_only,
        )

    def _apply_update(
        self,
        reduced: tuple[float, bool, dict[str, float]],
        counts: tuple[int, int],
        micro_batches: int,
        started: float,
        ends_batch: bool,
    ) -> StepResult:
        """Megatron's optimizer step, opened up: gradients are prepared and measured first so a non-finite norm
        skips the update (megatron would apply it for fp32/bf16, which have no loss scaler to catch it)."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        loss_sum, nonfinite_loss, metric_sums = reduced
        self._optimizer.prepare_grads()
        grad_norm = float(self._optimizer.get_grad_norm())
        config = self.config
        lr = base.scheduled_lr(config, self._counter.optimizer_steps)
        reason = base.skip_reason(nonfinite_loss, loss_sum, grad_norm, loss_tokens=counts[0])
        if reason is None:
            for group in self._optimizer.param_groups:
                # megatron's scheduler normally applies these; its groups mark biases and norm gains with
                # wd_mult=0 (no decay, as in the torch trainer) and leave the product to the scheduler.
                group["lr"] = lr
                group["weight_decay"] = config.weight_decay * group.get("wd_mult", 1.0)
            for inner in optimizer.inner_optimizers(self._optimizer):
                parameters = inner.get_parameters()
                if config.grad_clip is not None and parameters:
                    clip_grad_by_total_norm_fp32(parameters, max_norm=config.grad_clip, total_norm=grad_norm)
            self._optimizer.step_with_ready_grads()
        self._counter.after_step(applied=reason is None, ends_batch=ends_batch)
        self._module.zero_grad_buffer()
        self._optimizer.zero_grad()
        return base.step_result(
            self._counter.version,
            metric_sums,
            loss=loss_sum,
            lr=lr,
            grad_norm=grad_norm,
            loss_tokens=counts[0],
            sequences=counts[1],
            micro_batches=micro_batches,
            started=started,
            skip_reason=reason,
        )

    def _save_into(self, staging: Path, state: dict[str, Any]) -> None:
        from megatron.core import dist_checkpointing

        model_state = self._stage.sharded_state_dict(metadata=_CHECKPOINT_METADATA)
        sharded = {"model": model_state}
        if self.config.save_optimizer:  # else a resumed run starts a fresh optimizer (slime's --no-save-optim)
            sharded["optimizer"] = self._optimizer.sharded_state_dict(model_state, metadata=_CHECKPOINT_METADATA)
        dist_checkpointing.save(sharded, str(staging))
        if dist.get_rank() == 0:
            checkpoint.write_state(staging, {**state, OPTIMIZER_SAVED: self.config.save_optimizer})

    def _load_weights_from(self, directory: Path) -> None:
        """Weights only (no optimizer state, version 0): a converted HF model or another run's checkpoint."""
        from megatron.core import dist_checkpointing

        if not directory.is_dir():
            raise FileNotFoundError(f"initial checkpoint {directory}: no such directory")
        model_state = self._stage.sharded_state_dict(metadata=_CHECKPOINT_METADATA)
        loaded = dist_checkpointing.load({"model": model_state}, str(directory))
        self._stage.load_state_dict(loaded["model"])

    def _build_frozen(self, path: Path, dtype: torch.dtype) -> tuple[nn.Module, nn.Module]:
        """The frozen model as forwards run it, and its GPTModel stage (the same module unless bf16 wraps it)."""
        bridge = HFBridge(path, dtype=dtype, runtime=self._bridge.runtime)
        stage = bridge.build_stage()
        bridge.load_hf_weights([stage])
        stage.requires_grad_(False)
        return _maybe_float16(stage, bridge.transformer_config), stage

    def _build_teacher(self, name: str, path: Path, dtype: torch.dtype) -> nn.Module:
        """A teacher is a model of its own shape, which may not load or split at the policy's layout (heads over TP,
        layers over PP): megatron's reason, prefixed with the teacher it is about."""
        try:
            return self._build_frozen(path, dtype)[0]
        except (OSError, ValueError, AssertionError) as error:
            layout = f"TP={self.config.tensor_model_parallel_size} x PP={self.config.pipeline_model_parallel_size}"
            raise ValueError(f"distillation teacher {name!r} ({path}) cannot be held by the Megatron trainer at "
                             f"{layout}: {error}") from error


class _StepStats(base.StepStats):
    """Loss and metric sums of this rank's micro-batches, combined over the ranks that computed them."""

    def reduce(self, *, contributes: bool) -> tuple[float, bool, dict[str, float]]:
        """Only the last pipeline stage computes losses, and its TP ranks compute identical ones: exactly one
        rank per data-parallel replica contributes. Gathered as objects since only some ranks know the keys."""
        mine = (self.loss_sum, self.nonfinite, self.metric_sums) if contributes else None
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        loss_sum, nonfinite, sums = 0.0, False, {}
        for entry in gathered:
            if entry is None:
                continue
            loss_sum += entry[0]
            nonfinite |= entry[1]
            for key, value in entry[2].items():
                sums[key] = sums.get(key, 0.0) + value
        return loss_sum, nonfinite, sums


def _wrap_ddp(module: nn.Module, config: MegatronTrainerConfig) -> nn.Module:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=config.use_distributed_optimizer,
        check_for_nan_in_grad=False,
        bucket_size=None,
    )
    inner = module.module if hasattr(module, "module") and not isinstance(module, nn.ModuleList) else module
    return DistributedDataParallel(config=inner.config, ddp_config=ddp_config, module=module)


def _maybe_float16(stage: nn.Module, transformer_config: Any) -> nn.Module:
    if not transformer_config.bf16:
        return stage
    from megatron.core.transformer.module import Float16Module

    return Float16Module(transformer_config, stage)


def _finalize_summed_grads(model: list[nn.Module], num_tokens: Tensor | None = None, **kwargs: Any) -> None:
    """megatron's gradient finalisation (DP reduction, tied-embedding sync) without the division by the token
    count that `calculate_per_token_loss` implies: our losses are already normalised (module docstring)."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, num_tokens=None, **kwargs)


def _response_offsets(samples: Sequence[TrainSample]) -> list[int]:
    offsets = [0]
    for sample in samples:
        offsets.append(offsets[-1] + sample.response_length)
    return offsets
