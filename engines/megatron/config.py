"""Typed, validated-once configuration of the Megatron trainer."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class MegatronTrainerConfig(BaseModel):
    """Everything `MegatronTrainer` needs; parallel sizes are checked against the world size at construction.

    `dtype` is the COMPUTE dtype: with "bfloat16" megatron keeps float32 master weights in its optimizer (the
    same rule as the torch trainer: bf16 parameters cannot represent RL-sized updates). `micro_batch_tokens`
    bounds the padded tokens (rows x longest row) of one forward pass. `initial_checkpoint` is a Megatron
    distributed checkpoint (from `tools/convert_checkpoint.py` or a trainer checkpoint) whose weights replace
    the Hugging Face ones at start-up; `model_path` still provides the architecture, tokenizer and export config.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_path: Path
    ref_model_path: Path | None = None
    initial_checkpoint: Path | None = None
    tensor_model_parallel_size: int = Field(default=1, ge=1)
    pipeline_model_parallel_size: int = Field(default=1, ge=1)
    use_distributed_optimizer: bool = True
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

    @model_validator(mode="after")
    def _check_cross_fields(self) -> MegatronTrainerConfig:
        for index, beta in enumerate(self.betas):
            if not 0 <= beta < 1:
                raise ValueError(f"betas[{index}]={beta} must be in [0, 1)")
        if self.lr_schedule == "cosine" and (self.total_steps is None or self.total_steps <= self.warmup_steps):
            raise ValueError(
                f"lr_schedule='cosine' needs total_steps > warmup_steps, got {self.total_steps} <= {self.warmup_steps}"
            )
        return self

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size
