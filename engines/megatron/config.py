"""Typed, validated-once configuration of the Megatron trainer."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from engines.megatron.model_flags import MegatronFlags, refuse_unsupported
from engines.training.config import TrainerOptimizerConfig


class MegatronTrainerConfig(TrainerOptimizerConfig):
    """Everything `MegatronTrainer` needs; parallel sizes are checked against the world size at construction.

        `dtype` is the COMPUTE dtype: with "bfloat16" megatron keeps float32 master weights in its optimizer (the
    same rule as the torch trainer: bf16 parameters cannot represent RL-sized updates). `micro_batch_tokens`
    bounds the tokens of one forward pass, padding included; `qkv_format` lays them out as packed sequences
    ("thd", one row per micro-batch, as slime trains) or as padded rows ("bshd"), see `engines.megatron.batches`.
    `initial_checkpoint` is a Megatron distributed checkpoint (from `tools/convert_checkpoint.py` or a trainer
    checkpoint) whose weights replace the Hugging Face ones at start-up; `model_path` still provides the
    architecture, tokenizer and export config. `model_flags` are Megatron's own flags as a slime script passes
    them (`engines.megatron.model_flags`): what this trainer cannot honour is refused here, the model-shape ones
    are checked when the checkpoint is read. `expert_model_parallel_size` splits a mixture-of-experts model's
    experts over that many data-parallel ranks; `expert_tensor_parallel_size` splits each expert like the attention
    (None: megatron's default, the attention's TP) or not at all (1, as slime's MoE scripts run).
    `use_routing_replay` makes every policy `compute_log_probs` return the experts its forward chose per sample
    (`ModelOutputs.routed_experts`), for the training forwards of those samples to replay (slime's R2).
    """

    initial_checkpoint: Path | None = None
    tensor_model_parallel_size: int = Field(default=1, ge=1)
    pipeline_model_parallel_size: int = Field(default=1, ge=1)
    expert_model_parallel_size: int = Field(default=1, ge=1)
    expert_tensor_parallel_size: int | None = Field(default=None, ge=1)
    use_distributed_optimizer: bool = True
    qkv_format: Literal["thd", "bshd"] = "thd"
    model_flags: MegatronFlags = Field(default_factory=MegatronFlags)
    use_routing_replay: bool = False

    @model_validator(mode="after")
    def _refuse_unsupported_flags(self) -> MegatronTrainerConfig:
        refuse_unsupported(self.model_flags.flags, megatron_core=True)
        if self.stateless_adam:
            raise ValueError("stateless_adam: the Megatron trainer runs megatron's own Adam (its optimizer module's "
                             "choices); --train-backend torch trains with stateless Adam")
        expert_tp = self.expert_tensor_parallel_size
        if expert_tp not in (None, 1, self.tensor_model_parallel_size):
            raise ValueError(f"expert_tensor_parallel_size {expert_tp}: the Megatron backend splits experts like "
                             f"the attention (tensor_model_parallel_size {self.tensor_model_parallel_size}) or not "
                             "at all (1)")
        return self
