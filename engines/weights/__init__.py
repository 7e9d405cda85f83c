"""Weight transfer from the learner to the inference engines: bucketed broadcast over a dedicated group."""

from __future__ import annotations

from engines.weights.base import LoadFn, TransferReport, WeightReceiver, WeightSender, WeightTransferError
from engines.weights.group import GroupSpec
from engines.weights.manifest import Manifest, TensorSpec, plan_buckets
from engines.weights.torch_distributed import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_DIRECT_BYTES,
    TorchDistributedWeightReceiver,
    TorchDistributedWeightSender,
)

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_DIRECT_BYTES",
    "GroupSpec",
    "LoadFn",
    "Manifest",
    "TensorSpec",
    "TorchDistributedWeightReceiver",
    "TorchDistributedWeightSender",
    "TransferReport",
    "WeightReceiver",
    "WeightSender",
    "WeightTransferError",
    "plan_buckets",
]
