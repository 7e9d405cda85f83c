"""Training engines: the `Trainer` interface, the batch layout it shares with policies, and the torch trainer.

`TorchTrainer` imports transformers, so it is loaded lazily: code that only needs the layout types (the learner's
batch assembly, tests of losses) does not pay for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engines.training.base import (
    Loss,
    ModelOutputs,
    PackedBatch,
    StepResult,
    Trainer,
    TrainSample,
)
from engines.training.config import TorchTrainerConfig

if TYPE_CHECKING:
    from engines.training.torch_trainer import TorchTrainer

__all__ = [
    "Loss",
    "ModelOutputs",
    "PackedBatch",
    "StepResult",
    "TorchTrainer",
    "TorchTrainerConfig",
    "TrainSample",
    "Trainer",
]


def __getattr__(name: str) -> Any:
    if name == "TorchTrainer":
        from engines.training.torch_trainer import TorchTrainer

        return TorchTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
