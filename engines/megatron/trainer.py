"""The Megatron-core trainer: a GPT model built from an HF checkpoint, split over TP x PP x DP ranks.

Calls. Every method is collective over all learner ranks, and every rank passes the SAME, whole batch: the
trainer takes its data-parallel shard itself (`engines.megatron.batches`). Results are identical on every rank
(log-probs of the whole batch, the step's metrics), so the caller never needs to know the parallel layout.

Step. One megatron pipeline schedule per step runs this rank's micro-batches (padded rows, see `batches`);
the loss of each micro-batch comes from `policies/` through `LossFn`, already normalised by the step's global
counts (`LossNormalizer`, computed from the whole batch every rank holds). So gradients must be SUMMED over
micro-batches and DP ranks: `calculate_per_token_loss` stops the schedule from dividing by the micro-batch
count and megatron's DDP from averaging over DP, and our `finalize_model_grads` wrapper drops the token-count
rescaling that flag would otherwise apply. The optimizer step is megatron's own (distributed optimizer
optional), split open so that a non-finite loss or gradient norm skips the update like the torch trainer does.

CPU. Without CUDA every call into megatron runs inside `cpu_compat()` (see that module); with CUDA it is never
entered.

Checkpoints are megatron distributed checkpoints (resharding: save at one TP/PP/DP layout, load at another) plus
`trainer_state.json` (version, extra state), written to a staging directory and renamed into place.
"""

from __future__ import annotations

import contextlib
import functools
import math
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import Tensor, nn

from engines.megatron import parallel
from engines.megatron.batches import PaddedMicroBatch, plan_padded_micro_batches, shard_for_rank
from engines.megatron.bridge import HFBridge
from engines.megatron.config import MegatronTrainerConfig
from engines.megatron.cpu_compat import maybe_cpu_compat
from engines.megatron.logprobs import vocab_parallel_log_probs
from engines.training import checkpoint
from engines.training.base import (
    LossFn,
    LossNormalizer,
    ModelOutputs,
    ModelRole,
    StepResult,
    Trainer,
    TrainSample,
    step_result,
)
from engines.training.packing import count_loss_tokens
from engines.training.schedule import lr_multiplier

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_HF_CONFIG_FILES = ("config.json", "generation_config.json")
# Optimizer state stored per parameter in model space, so a checkpoint loads at any TP/PP/DP layout.
_CHECKPOINT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


class MegatronTrainer(Trainer):
    """See the module docstring. Construct on every learner rank (torch.distributed initialised or not)."""

    def __init__(self, config: MegatronTrainerConfig) -> None:
        self.config = config
        self._owns_world = parallel.ensure_default_group()
        self._version = 0
        with maybe_cpu_compat():
            parallel.initialize_model_parallel(
                config.tensor_model_parallel_size, config.pipeline_model_parallel_size, config.seed
            )
            dtype = _DTYPES[config.dtype]
            self._bridge = HFBridge(config.model_path, dtype=dtype)
            stage = self._bridge.build_stage()
            self._bridge.load_hf_weights([stage])
            self._stage = stage
            self._module = _wrap_ddp(_maybe_float16(stage, self._bridge.transformer_config), config)
            self._optimizer = _build_optimizer(config, self._module)
            transformer_config = self._bridge.transformer_config
            transformer_config.finalize_model_grads_func = _finalize_summed_grads
            transformer_config.no_sync_func = self._module.no_sync
            self._ref: nn.Module | None = None
            if config.ref_model_path is not None:
                self._ref = self._build_frozen(config.ref_model_path, dtype)
            if config.initial_checkpoint is not None:
                self._load_weights_from(Path(config.initial_checkpoint))

    # -- Trainer ---------------------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    def compute_log_probs(
        self,
        samples: Sequence[TrainSample],
        *,
        temperature: float,
        with_entropy: bool = False,
        model: ModelRole = "policy",
    ) -> ModelOutputs:
        """The whole batch's log-probs on every rank, packed in sample order, on the CPU, without gradients."""
        network = self._select_model(model)
        _validate(samples)
        offsets = _response_offsets(samples)
        log_probs = torch.zeros(offsets[-1], dtype=torch.float32)
        entropy = torch.zeros(offsets[-1], dtype=torch.float32) if with_entropy else None

        def collect(micro_batch: PaddedMicroBatch, outputs: ModelOutputs) -> Tensor:
            lengths = micro_batch.response_lengths.tolist()
            for index, values in zip(micro_batch.members, outputs.log_probs.split(lengths), strict=True):
                log_probs[offsets[index] : offsets[index + 1]] = values.float().cpu()
            if entropy is not None and outputs.entropy is not None:
                for index, values in zip(micro_batch.members, outputs.entropy.split(lengths), strict=True):
                    entropy[offsets[index] : offsets[index + 1]] = values.float().cpu()
            return outputs.log_probs.sum() * 0.0

        with maybe_cpu_compat(), torch.no_grad():
            if samples:
                network.eval()
                micro_batches = self._micro_batches(samples, with_batch=False)
                self._run_schedule(network, micro_batches, collect, temperature, with_entropy, forward_only=True)
            # Exactly one rank (last stage, TP rank 0) wrote each position; a sum over the world spreads them.
            if not (parallel.is_last_stage() and parallel.tp_rank() == 0):
                log_probs.zero_()
                if entropy is not None:
                    entropy.zero_()
            for values in (log_probs, entropy):
                if values is not None and dist.get_world_size() > 1:
                    dist.all_reduce(values)
        return ModelOutputs(log_probs=log_probs, entropy=entropy)

    def train_step(
        self, samples: Sequence[TrainSample], loss_fn: LossFn, *, temperature: float, with_entropy: bool = False
    ) -> StepResult:
        started = time.perf_counter()
        _validate(samples)
        _, data_parallel = parallel.dp_rank_and_size()
        if len(samples) < data_parallel:
            raise ValueError(
                f"train_step: {len(samples)} sample(s) cannot be split over {data_parallel} data-parallel ranks"
            )
        normalizer = LossNormalizer(loss_tokens=count_loss_tokens(samples), sequences=len(samples))
        stats = _StepStats()

        def loss_of(micro_batch: PaddedMicroBatch, outputs: ModelOutputs) -> Tensor:
            assert micro_batch.batch is not None
            loss, metrics = loss_fn(outputs, micro_batch.batch, normalizer)
            _check_loss(loss)
            stats.add(float(loss.detach()), metrics)
            return loss

        with maybe_cpu_compat():
            self._module.train()
            self._module.zero_grad_buffer()
            self._optimizer.zero_grad()
            micro_batches = self._micro_batches(samples, with_batch=True)
            self._run_schedule(self._module, micro_batches, loss_of, temperature, with_entropy, forward_only=False)
            reduced = stats.reduce(contributes=parallel.is_last_stage() and parallel.tp_rank() == 0)
            return self._apply_update(reduced, normalizer, len(micro_batches), started)

    def save_checkpoint(self, directory: str | Path, extra_state: dict[str, Any]) -> None:
        """Every rank writes its shards into one staging directory; rank 0 adds the state file and renames."""
        checkpoint.check_json(extra_state)
        state = {
            "version": self._version,
            "config": self.config.model_dump(mode="json"),
            "format": "megatron-dist",
            "extra_state": extra_state,
        }
        with maybe_cpu_compat():
            _on_all_ranks_atomically(Path(directory), lambda staging: self._save_into(staging, state))

    def save_model_only(self, directory: str | Path, extra_state: dict[str, Any]) -> None:
        """Weights only, as a distributed checkpoint that `initial_checkpoint` (or another layout) loads."""
        from megatron.core import dist_checkpointing

        checkpoint.check_json(extra_state)
        state = {"version": self._version, "format": "megatron-dist-model", "extra_state": extra_state}

        def write(staging: Path) -> None:
            dist_checkpointing.save({"model": self._stage.sharded_state_dict()}, str(staging))
            if dist.get_rank() == 0:
                checkpoint.write_state(staging, state)

        with maybe_cpu_compat():
            _on_all_ranks_atomically(Path(directory), write)

    def load_checkpoint(self, directory: str | Path) -> dict[str, Any]:
        directory = Path(directory)
        state = checkpoint.read_state(directory)
        from megatron.core import dist_checkpointing

        with maybe_cpu_compat():
            _prime_adam_state(self._optimizer)
            model_state = self._stage.sharded_state_dict(metadata=_CHECKPOINT_METADATA)
            optimizer_state = self._optimizer.sharded_state_dict(
                model_state, is_loading=True, metadata=_CHECKPOINT_METADATA
            )
            sharded = {"model": model_state, "optimizer": optimizer_state}
            loaded = dist_checkpointing.load(sharded, str(directory))
            self._stage.load_state_dict(loaded["model"])
            with _step_tolerant_state_loading(self._optimizer):
                self._optimizer.load_state_dict(loaded["optimizer"])
            _unshare_adam_steps(self._optimizer)
        self._version = int(state["version"])
        return state["extra_state"]

    def named_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """HF names and layouts, TP shards gathered and PP stages broadcast. COLLECTIVE: every learner rank must
        iterate it to the end (every rank receives every tensor; the weight sender uses rank 0's)."""
        inner = self._bridge.export_hf_weights([self._stage])
        while True:
            with maybe_cpu_compat():
                item = next(inner, None)
            if item is None:
                return
            yield item

    def export_hf(self, directory: str | Path) -> None:
        tensors = {name: tensor.detach().cpu().contiguous().clone() for name, tensor in self.named_tensors()}
        source = Path(self.config.model_path)

        def write() -> None:
            with checkpoint.atomic_directory(directory) as staging:
                checkpoint.copy_auxiliary_files(source, staging)
                for name in _HF_CONFIG_FILES:
                    if (source / name).is_file():
                        shutil.copy2(source / name, staging / name)
                save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})

        _on_rank_zero(write, f"exporting {directory}")

    def close(self) -> None:
        """Tear down megatron's groups (and the world, if this trainer created it)."""
        parallel.destroy_model_parallel()
        if self._owns_world and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_world = False

    # -- internals ---------------------------------------------------------------------------------------------

    def _micro_batches(self, samples: Sequence[TrainSample], *, with_batch: bool) -> list[PaddedMicroBatch]:
        rank, ranks = parallel.dp_rank_and_size()
        members = shard_for_rank([int(s.tokens.numel()) for s in samples], ranks, rank)
        return plan_padded_micro_batches(samples, members, self.config.micro_batch_tokens, with_batch=with_batch)

    def _run_schedule(
        self,
        network: nn.Module,
        micro_batches: list[PaddedMicroBatch],
        on_outputs: Callable[[PaddedMicroBatch, ModelOutputs], Tensor],
        temperature: float,
        with_entropy: bool,
        *,
        forward_only: bool,
    ) -> None:
        """One megatron schedule (pipelined when PP > 1) over this rank's micro-batches."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        vocab_size = self._bridge.vocab_size

        def loss_func(micro_batch: PaddedMicroBatch, logits: Tensor) -> tuple[Tensor, Tensor, dict[str, Any]]:
            selected = logits[micro_batch.logit_rows, micro_batch.logit_columns]
            outputs = vocab_parallel_log_probs(
                selected,
                micro_batch.targets,
                temperature=temperature,
                with_entropy=with_entropy,
                vocab_size=vocab_size,
            )
            return on_outputs(micro_batch, outputs), torch.tensor(1, dtype=torch.int), {}

        def forward_step(data: Iterator[PaddedMicroBatch], model: nn.Module) -> tuple[Tensor, Callable[..., Any]]:
            micro_batch = next(data)
            output = model(micro_batch.input_ids, micro_batch.position_ids, None)
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
        normalizer: LossNormalizer,
        micro_batches: int,
        started: float,
    ) -> StepResult:
        """Megatron's optimizer step, opened up: gradients are prepared and measured first so a non-finite norm
        skips the update (megatron would apply it for fp32/bf16, which have no loss scaler to catch it)."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        loss_sum, nonfinite_loss, metric_sums = reduced
        self._optimizer.prepare_grads()
        grad_norm = float(self._optimizer.get_grad_norm())
        config = self.config
        lr = config.lr * lr_multiplier(
            self._version,
            schedule=config.lr_schedule,
            warmup_steps=config.warmup_steps,
            total_steps=config.total_steps,
            min_lr_ratio=config.min_lr_ratio,
        )
        skip_reason = None
        if nonfinite_loss:
            skip_reason = f"non-finite loss ({loss_sum})"
        elif not math.isfinite(grad_norm):
            skip_reason = f"non-finite gradient norm ({grad_norm})"
        if skip_reason is None:
            for group in self._optimizer.param_groups:
                # megatron's scheduler normally applies these; its groups mark biases and norm gains with
                # wd_mult=0 (no decay, as in the torch trainer) and leave the product to the scheduler.
                group["lr"] = lr
                group["weight_decay"] = config.weight_decay * group.get("wd_mult", 1.0)
            for optimizer in getattr(self._optimizer, "chained_optimizers", [self._optimizer]):
                parameters = optimizer.get_parameters()
                if config.grad_clip is not None and parameters:
                    clip_grad_by_total_norm_fp32(parameters, max_norm=config.grad_clip, total_norm=grad_norm)
            self._optimizer.step_with_ready_grads()
            self._version += 1
        self._module.zero_grad_buffer()
        self._optimizer.zero_grad()
        return step_result(
            self._version,
            metric_sums,
            loss=loss_sum,
            lr=lr,
            grad_norm=grad_norm,
            normalizer=normalizer,
            micro_batches=micro_batches,
            started=started,
            skip_reason=skip_reason,
        )

    def _save_into(self, staging: Path, state: dict[str, Any]) -> None:
        from megatron.core import dist_checkpointing

        model_state = self._stage.sharded_state_dict(metadata=_CHECKPOINT_METADATA)
        optimizer_state = self._optimizer.sharded_state_dict(model_state, metadata=_CHECKPOINT_METADATA)
        sharded = {"model": model_state, "optimizer": optimizer_state}
        dist_checkpointing.save(sharded, str(staging))
        if dist.get_rank() == 0:
            checkpoint.write_state(staging, state)

    def _load_weights_from(self, directory: Path) -> None:
        """Weights only (no optimizer state, version 0): a converted HF model or another run's checkpoint."""
        from megatron.core import dist_checkpointing

        if not directory.is_dir():
            raise FileNotFoundError(f"initial checkpoint {directory}: no such directory")
        model_state = self._stage.sharded_state_dict(metadata=_CHECKPOINT_METADATA)
        loaded = dist_checkpointing.load({"model": model_state}, str(directory))
        self._stage.load_state_dict(loaded["model"])

    def _build_frozen(self, path: Path, dtype: torch.dtype) -> nn.Module:
        bridge = HFBridge(path, dtype=dtype)
        stage = bridge.build_stage()
        bridge.load_hf_weights([stage])
        stage.requires_grad_(False)
        return _maybe_float16(stage, bridge.transformer_config)

    def _select_model(self, role: ModelRole) -> nn.Module:
        if role == "policy":
            return self._module
        if role == "ref":
            if self._ref is None:
                raise ValueError("compute_log_probs(model='ref') needs ref_model_path in the trainer config")
            return self._ref
        raise ValueError(f"model must be 'policy' or 'ref', got {role!r}")


class _StepStats:
    """Loss and metric sums of this rank's micro-batches, combined over the ranks that computed them."""

    def __init__(self) -> None:
        self.loss_sum = 0.0
        self.nonfinite = False
        self.metric_sums: dict[str, float] = {}

    def add(self, loss: float, metrics: dict[str, float]) -> None:
        self.loss_sum += loss
        self.nonfinite |= not math.isfinite(loss)
        for key, value in metrics.items():
            self.metric_sums[key] = self.metric_sums.get(key, 0.0) + float(value)

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


def _build_optimizer(config: MegatronTrainerConfig, module: nn.Module) -> Any:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    optimizer_config = OptimizerConfig(
        optimizer="adam",
        lr=config.lr,
        weight_decay=config.weight_decay,
        adam_beta1=config.betas[0],
        adam_beta2=config.betas[1],
        adam_eps=config.eps,
        clip_grad=0.0,  # clipping is applied in MegatronTrainer._apply_update, after the finiteness check
        use_distributed_optimizer=config.use_distributed_optimizer,
        params_dtype=torch.float32,
        bf16=config.dtype == "bfloat16",
    )
    return get_megatron_optimizer(optimizer_config, [module])


def _prime_adam_state(optimizer: Any) -> None:
    """Give every parameter of a fresh torch AdamW its state (zero moments, step 0) before a checkpoint loads.

    megatron-core 0.16 falls back to torch's AdamW without transformer-engine/apex, but its state initialiser
    only creates the moments, not the `step` entry its own distributed-optimizer `state_dict()` then requires;
    loading into a trainer that has not stepped yet would fail. The values are overwritten by the load.
    """
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = getattr(inner, "optimizer", None)
        if not isinstance(torch_optimizer, torch.optim.AdamW):
            continue
        for group in torch_optimizer.param_groups:
            for parameter in group["params"]:
                state = torch_optimizer.state[parameter]
                if not state:
                    state["exp_avg"] = torch.zeros_like(parameter)
                    state["exp_avg_sq"] = torch.zeros_like(parameter)
                    state["step"] = torch.tensor(0.0)


@contextlib.contextmanager
def _step_tolerant_state_loading(optimizer: Any) -> Iterator[None]:
    """Work around megatron-core 0.16 loading a fully-reshardable distributed-optimizer checkpoint into torch's
    AdamW: it first sets every parameter's `step` from the checkpoint's param groups, then copies each state
    entry from the per-parameter tensors, which carry no `step` (KeyError). We let the copy keep the `step` it
    just set."""
    patched = []
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        original = getattr(inner, "_set_main_param_and_optimizer_states", None)
        if original is None:
            continue

        def tolerant(
            model_param: Any, tensors: dict[str, Tensor], inner: Any = inner, original: Any = original
        ) -> None:
            group_index, group_order = inner.model_param_group_index_map[model_param]
            main_param = inner.optimizer.param_groups[group_index]["params"][group_order]
            step = inner.optimizer.state[main_param].get("step")
            original(model_param, tensors if step is None or "step" in tensors else {**tensors, "step": step})

        inner._set_main_param_and_optimizer_states = tolerant
        patched.append(inner)
    try:
        yield
    finally:
        for inner in patched:
            del inner._set_main_param_and_optimizer_states


def _unshare_adam_steps(optimizer: Any) -> None:
    """Give every parameter its own AdamW `step` tensor again after a distributed-optimizer load.

    megatron-core 0.16 (without apex/transformer-engine) restores `step` by assigning ONE tensor to every
    parameter's state. torch's AdamW increments each parameter's step in place, so the shared tensor advanced
    once per parameter on the first resumed step and later parameters got the wrong bias correction: the
    resumed step differed from the uninterrupted one by up to 3e-5 (found by the DP=2 resume parity test).
    """
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = getattr(inner, "optimizer", None)
        if not isinstance(torch_optimizer, torch.optim.Optimizer):
            continue
        for state in torch_optimizer.state.values():
            step = state.get("step")
            if isinstance(step, Tensor):
                state["step"] = step.detach().clone()


def _finalize_summed_grads(model: list[nn.Module], num_tokens: Tensor | None = None, **kwargs: Any) -> None:
    """megatron's gradient finalisation (DP reduction, tied-embedding sync) without the division by the token
    count that `calculate_per_token_loss` implies: our losses are already normalised (module docstring)."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, num_tokens=None, **kwargs)


def _on_all_ranks_atomically(target: Path, write: Callable[[Path], None]) -> None:
    """All ranks write into one staging directory that rank 0 renames into place once everyone finished; a
    failure anywhere raises on every rank and leaves any previous checkpoint under `target` untouched."""
    rank = dist.get_rank()
    names = [f".{target.name}.staging-{uuid.uuid4().hex[:12]}"]
    dist.broadcast_object_list(names, src=0)
    staging = target.parent / names[0]
    failure: BaseException | None = None
    try:
        if rank == 0:
            staging.mkdir(parents=True)
        dist.barrier()
        write(staging)
    except Exception as error:  # re-raised below, after every rank heard about it
        failure = error
    if _any_rank_failed(failure) is False and rank == 0:
        try:
            checkpoint.publish_directory(staging, target)
        except Exception as error:
            failure = error
    failed = _any_rank_failed(failure)
    if rank == 0 and failed:
        shutil.rmtree(staging, ignore_errors=True)
    if failure is not None:
        raise failure
    if failed:
        raise RuntimeError(f"writing checkpoint {target} failed on another rank")


def _any_rank_failed(failure: BaseException | None) -> bool:
    flag = torch.tensor([int(failure is not None)])
    dist.all_reduce(flag)
    return bool(flag.item())


def _on_rank_zero(write: Callable[[], None], what: str) -> None:
    failure: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            write()
        except Exception as error:  # re-raised below, after the other ranks heard about it
            failure = error
    if _any_rank_failed(failure) and failure is None:
        raise RuntimeError(f"{what} failed on rank 0")
    if failure is not None:
        raise failure


def _response_offsets(samples: Sequence[TrainSample]) -> list[int]:
    offsets = [0]
    for sample in samples:
        offsets.append(offsets[-1] + sample.response_length)
    return offsets


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise TypeError(f"loss_fn must return a scalar tensor as its loss, got {type(loss).__name__}")
    if not loss.requires_grad:
        raise ValueError("loss_fn returned a loss with no gradient path to outputs.log_probs")


def _validate(samples: Sequence[TrainSample]) -> None:
    for index, sample in enumerate(samples):
        sample.validate(index)
