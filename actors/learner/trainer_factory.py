"""Which trainer a learner runs: `--train-backend` picks the implementation behind the `Trainer` interface.

Kept apart from the learner so a backend (and its heavy imports) loads only when chosen.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from actors.config import RunConfig


def build_trainer(config: RunConfig) -> Any:
    if config.hf_checkpoint is None:
        raise ValueError("--hf-checkpoint is required for the learner")
    if config.train_backend == "torch":
        return _build_torch_trainer(config)
    if config.train_backend == "megatron":
        return _build_megatron_trainer(config)
    raise NotImplementedError(f"--train-backend {config.train_backend}: not available in this build")


def _needs_ref(config: RunConfig) -> bool:
    return config.policy.use_kl_loss or config.policy.kl_coef > 0


def _shared_settings(config: RunConfig) -> dict[str, Any]:
    """The `TrainerOptimizerConfig` fields, which every backend's config takes from the same flags."""
    assert config.hf_checkpoint is not None  # build_trainer checked it
    return {
        "model_path": Path(config.hf_checkpoint),
        "ref_model_path": Path(config.ref_checkpoint or config.hf_checkpoint) if _needs_ref(config) else None,
        "lr": config.lr,
        "betas": (config.adam_beta1, config.adam_beta2),
        "weight_decay": config.weight_decay,
        "lr_schedule": config.lr_decay_style,
        "warmup_steps": config.lr_warmup_iters,
        "total_steps": config.num_rollout if config.lr_decay_style == "cosine" else None,
        "min_lr_ratio": config.min_lr / config.lr if config.lr > 0 else 0.0,
        "grad_clip": config.clip_grad,
        "micro_batch_tokens": config.micro_batch_tokens,
        "dtype": "bfloat16" if config.bf16 else "float32",
        "seed": config.seed,
    }


def _build_torch_trainer(config: RunConfig) -> Any:
    from engines.training.config import TorchTrainerConfig
    from engines.training.torch_trainer import TorchTrainer

    # "cuda" resolves to cuda:LOCAL_RANK in the trainer; each learner rank sets LOCAL_RANK (actors/learner_ranks.py).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return TorchTrainer(TorchTrainerConfig(**_shared_settings(config), device=device))


def _build_megatron_trainer(config: RunConfig) -> Any:
    """Every learner rank builds one; the trainer makes its own world-size-1 group if none exists yet.

    Unlike the torch trainer, the Megatron trainer wants the WHOLE batch on every rank (it shards itself).
    """
    try:
        from engines.megatron import MegatronTrainer, MegatronTrainerConfig
    except ImportError as error:  # pragma: no cover - depends on the install
        raise ImportError(f"--train-backend megatron needs the megatron extra installed: {error}") from error

    return MegatronTrainer(
        MegatronTrainerConfig(
            **_shared_settings(config),
            initial_checkpoint=Path(config.megatron_checkpoint) if config.megatron_checkpoint else None,
            tensor_model_parallel_size=config.tensor_model_parallel_size,
            pipeline_model_parallel_size=config.pipeline_model_parallel_size,
            use_distributed_optimizer=config.use_distributed_optimizer,
        )
    )
