"""Weight transfer from the learner to the inference engines: one sender/loader pair per mechanism.

`transport.py` names the mechanisms; the torch ones live beside it. The names below are imported on first use,
so importing `engines.weights.transport` (which a rollout worker does) does not import torch through here.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LoadFn": "engines.weights.base",
    "TransferReport": "engines.weights.base",
    "WeightReceiver": "engines.weights.base",
    "WeightSender": "engines.weights.base",
    "WeightTransferError": "engines.weights.base",
    "GroupSpec": "engines.weights.group",
    "Manifest": "engines.weights.manifest",
    "TensorSpec": "engines.weights.manifest",
    "plan_buckets": "engines.weights.manifest",
    "DEFAULT_BUCKET_BYTES": "engines.weights.torch_distributed",
    "DEFAULT_DIRECT_BYTES": "engines.weights.torch_distributed",
    "TorchDistributedWeightReceiver": "engines.weights.torch_receiver",
    "TorchDistributedWeightSender": "engines.weights.torch_distributed",
    "SenderOptions": "engines.weights.transport",
    "WeightTransport": "engines.weights.transport",
    "resolve_transport": "engines.weights.transport",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engines.weights' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
