"""Which inference engine a rollout worker drives: `--rollout-engine` picks the `InferenceEngine` behind it."""

from __future__ import annotations

from typing import Any

from actors.config import RunConfig


def load_engine(config: RunConfig) -> tuple[Any, Any]:
    from transformers import AutoTokenizer

    from engines.inference.torch_engine import TorchEngine

    if config.hf_checkpoint is None:
        raise ValueError("--hf-checkpoint is required for the torch rollout engine")
    engine = TorchEngine.from_pretrained(config.hf_checkpoint, max_batch_size=config.rollout_max_batch_size)
    return engine, AutoTokenizer.from_pretrained(config.hf_checkpoint)
