"""Inference engines: the interface the rollout worker uses (`base.py`) and the embedded torch engine.

The torch engine's names load on first use (PEP 562), so importing the interface (every rollout worker does)
never imports torch or transformers: a worker driving SGLang or a plugin engine stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engines.inference.base import (
    ContextFull,
    FinishReason,
    GenerateOutput,
    GenerateRequest,
    InferenceEngine,
    KvCacheAccount,
    PauseMode,
    PrefixCacheStats,
    SamplingParams,
    continuation_request,
)

if TYPE_CHECKING:
    from engines.inference.batcher import BatchLimits, StepRecord
    from engines.inference.torch_engine import TorchEngine

_LAZY = {"BatchLimits": "engines.inference.batcher", "StepRecord": "engines.inference.batcher",
         "TorchEngine": "engines.inference.torch_engine"}

__all__ = [
    "BatchLimits",
    "ContextFull",
    "FinishReason",
    "GenerateOutput",
    "GenerateRequest",
    "InferenceEngine",
    "KvCacheAccount",
    "PauseMode",
    "PrefixCacheStats",
    "SamplingParams",
    "StepRecord",
    "TorchEngine",
    "continuation_request",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engines.inference' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
