"""The megatron-core training backend (`--train-backend megatron`): TP x PP x DP, distributed optimizer,
distributed checkpoints, HF weights in and out through mbridge. Imports megatron lazily: nothing here loads it
until a trainer is built."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engines.megatron.config import MegatronTrainerConfig

if TYPE_CHECKING:
    from engines.megatron.trainer import MegatronTrainer

__all__ = ["MegatronTrainer", "MegatronTrainerConfig"]


def __getattr__(name: str) -> Any:
    if name == "MegatronTrainer":
        from engines.megatron.trainer import MegatronTrainer

        return MegatronTrainer
    raise AttributeError(name)
