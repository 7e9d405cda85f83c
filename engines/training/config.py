"""Typed, validated-once configuration of the embedded torch trainer."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from engines.frozen_params import check_name_lists
from engines.training.lora import LoraSettings

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class CriticSettings(BaseModel):
    """PPO's value model (`engines.training.critic`): where its weights start and its own learning rate."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_path: Path
    lr: float = Field(default=1e-6, gt=0)
    stateless_adam: bool = False  # the policy's optimizer kind (`engines.training.optimizers`)


class MtpSettings(BaseModel):
    """Multi-token-prediction layers trained beside the policy (`engines.training.mtp`): slime's --mtp-num-layers
    and --mtp-loss-scaling-factor, under --enable-mtp-training."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_layers: int = Field(ge=1)
    loss_scaling_factor: float = Field(0.2, ge=0)


class TrainerOptimizerConfig(BaseModel):
    """What every trainer shares: the model to load, AdamW, the LR schedule, clipping, micro-batch budget, seed,
    and which parameters train.

    One definition, so a schedule rule (cosine needs total_steps) cannot differ between training backends.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_path: Path
    ref_model_path: Path | None = None
    teacher_model_paths: dict[str, Path] = Field(default_factory=dict)  # distillation teachers by name, frozen
    lr: float = Field(default=1e-6, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(default=0.0, ge=0)
    eps: float = Field(default=1e-8, gt=0)
    lr_schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = Field(default=0, ge=0)
    total_steps: int | None = Field(default=None, gt=0)
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    grad_clip: float | None = Field(default=1.0, gt=0)
    micro_batch_tokens: int = Field(default=8192, gt=0)
    dtype: Literal["float32", "bfloat16"] = "float32"
    seed: int = 0
    # slime's parameter freezing by name (`engines.frozen_params`): at most one of the two lists
    only_train_params_name_list: tuple[str, ...] = ()
    freeze_params_name_list: tuple[str, ...] = ()
    # False: checkpoints hold the weights without the optimizer state; loading one starts a fresh optimizer
    save_optimizer: bool = True
    # slime's --use-stateless-adam: Adam with its moments reset before every step (`engines.training.optimizers`)
    stateless_adam: bool = False

    @model_validator(mode="after")
    def _check_name_lists(self) -> TrainerOptimizerConfig:
        check_name_lists(self.only_train_params_name_list, self.freeze_params_name_list)
        return self

    @model_validator(mode="after")
    def _check_schedule(self) -> TrainerOptimizerConfig:
        for index, beta in enumerate(self.betas):
            if not 0 <= beta < 1:
                raise ValueError(f"betas[{index}]={beta} must be in [0, 1)")
        if self.lr_schedule == "cosine":
            if self.total_steps is None:
                raise ValueError("lr_schedule='cosine' needs total_steps")
            if self.total_steps <= self.warmup_steps:
                raise ValueError(
                    f"total_steps={self.total_steps} must exceed warmup_steps={self.warmup_steps} for a cosine decay"
                )
        return self


class TorchTrainerConfig(TrainerOptimizerConfig):
    """Everything `TorchTrainer` needs; cross-field rules are checked here, at start-up, not mid-run.

    `dtype` is the COMPUTE dtype. Master weights and AdamW moments always stay float32: at RL learning rates
    (~1e-6) a bfloat16 parameter cannot represent most updates, so training purely in bf16 silently stalls.
    `micro_batch_tokens` bounds the tokens (prompt + response) of one packed forward pass; a sample longer than
    the budget runs alone in its own micro-batch rather than failing the step.
    `attn_implementation` defaults to `packed_sdpa` (per-sequence attention inside a packed row, see
    `engines.training.attention`); "flash_attention_2" is the faster choice where it is installed, "sdpa" the
    conservative one (correct, but it computes masked cross-sequence scores).
    `critic` adds PPO's value model with its own optimizer (`engines.training.critic`), saved in every checkpoint.
    `lora` trains a LoRA adapter on the frozen model instead of every weight (`engines.training.lora`); the
    reference model is then the policy with its adapter switched off, unless `ref_model_path` names another
    model.
    `share_prompts` packs a group's prompt once for all its samples (`micro_batches.pack_inputs`): the same
    gradients, about half the tokens on short-response tasks. It needs an attention that reads the shared rows,
    so it applies only with `packed_sdpa`.
    `offload_optimizer` keeps the AdamW moments in host memory between steps (a colocated run: the engines
    generate on the same device meanwhile); a step brings them back first. Nothing moves on a CPU device.
    `fused_output_head` computes log-probs from hidden states a chunk of tokens at a time, never holding the
    [tokens x vocabulary] logits (`engines.training.output_head`); False keeps the plain path, which benchmarks
    compare against and which a model with post-processed logits takes anyway.
    `moe_aux_loss_coeff` and `moe_z_loss_coeff` add megatron's router losses of a mixture-of-experts model to
    every training forward (`engines.training.moe`); a dense model with either set is refused.
    `use_routing_replay` makes every policy `compute_log_probs` return the experts its forward chose per sample
    (`ModelOutputs.routed_experts`), for later forwards of those samples to replay.
    `context_parallel_size` splits every packed row across that many ranks (`engines.training.context_parallel`);
    the learner's world is then data-parallel replicas x context-parallel ranks.
    `freeze_vision_tower` (verl's name) keeps a vision-language model's vision tower as loaded: no gradient, no
    optimizer state, not pushed to the engines; False trains it with the language model (`engines.training.vision`).
    `mtp` trains multi-token-prediction layers beside the policy, a speculative-decoding draft that gives the policy
    no gradient (`engines.training.mtp`); their rows are packed unshared.
    """

    gradient_checkpointing: bool = False
    lora: LoraSettings | None = None
    critic: CriticSettings | None = None
    offload_optimizer: bool = False
    device: str = "cpu"
    attn_implementation: str = "packed_sdpa"
    check_packing: bool = True
    share_prompts: bool = True
    fused_output_head: bool = True
    moe_aux_loss_coeff: float = Field(0.0, ge=0)
    moe_z_loss_coeff: float = Field(0.0, ge=0)
    use_routing_replay: bool = False
    context_parallel_size: int = Field(1, ge=1)
    freeze_vision_tower: bool = True
    mtp: MtpSettings | None = None

    @model_validator(mode="after")
    def _check_device(self) -> TorchTrainerConfig:
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device {self.device!r} unsupported; use 'cpu' or 'cuda[:N]'")
        return self

    @model_validator(mode="after")
    def _check_context_parallel(self) -> TorchTrainerConfig:
        """A split row's attention is `packed_sdpa`'s (it gathers the keys), refused otherwise before a model loads."""
        if self.context_parallel_size > 1 and self.attn_implementation != "packed_sdpa":
            raise ValueError(f"context_parallel_size {self.context_parallel_size}: not available with "
                             f"attn_implementation {self.attn_implementation!r}; the split row needs 'packed_sdpa'")
        return self

    @model_validator(mode="after")
    def _check_mtp(self) -> TorchTrainerConfig:
        """MTP layers read whole rows of the full model's hidden states: refused where either is not there."""
        if self.mtp is not None and self.lora is not None:
            raise ValueError("--enable-mtp-training with LoRA: the MTP layers train whole, beside a full-weight "
                             "policy only")
        if self.mtp is not None and self.context_parallel_size > 1:
            raise ValueError(f"--enable-mtp-training with --context-parallel-size {self.context_parallel_size}: the "
                             "MTP layers need each row whole on one rank")
        return self

    @property
    def compute_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
