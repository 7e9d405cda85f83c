"""Which trainer a learner runs: `--train-backend` picks the implementation behind the `Trainer` interface.

Kept apart from the learner so a backend (and its heavy imports) loads only when chosen.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from actors.config import RunConfig


def build_trainer(config: RunConfig) -> Any:
    if config.train_backend != "torch":
        raise NotImplementedError(f"--train-backend {config.train_backend}: not available in this build")
    from engines.training.config import TorchTrainerConfig
    from engines.training.torch_trainer import TorchTrainer

    if config.hf_checkpoint is None:
        raise ValueError("--hf-checkpoint is required for the learner")
    needs_ref = config.policy.use_kl_loss or config.policy.kl_coef > 0
    return TorchTrainer(
        TorchTrainerConfig(
            model_path=Path(config.hf_checkpoint),
            ref_model_path=Path(config.ref_checkpoint or config.hf_checkpoint) if needs_ref else None,
            lr=config.lr,
            betas=(config.adam_beta1, config.adam_beta2),
            weight_decay=config.weight_decay,
            lr_schedule=config.lr_decay_style,
            warmup_steps=config.lr_warmup_iters,
            total_steps=config.num_rollout if config.lr_decay_style == "cosine" else None,
            grad_clip=config.clip_grad,
            micro_batch_tokens=config.micro_batch_tokens,
            seed=config.seed,
        )
    )
