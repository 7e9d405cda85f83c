"""Inference engines: the interface the rollout worker uses (`base.py`) and the embedded torch engine."""

from engines.inference.base import (
    FinishReason,
    GenerateOutput,
    GenerateRequest,
    InferenceEngine,
    PauseMode,
    SamplingParams,
    continuation_request,
)
from engines.inference.batcher import BatchLimits, StepRecord
from engines.inference.torch_engine import TorchEngine

__all__ = [
    "BatchLimits",
    "FinishReason",
    "GenerateOutput",
    "GenerateRequest",
    "InferenceEngine",
    "PauseMode",
    "SamplingParams",
    "StepRecord",
    "TorchEngine",
    "continuation_request",
]
