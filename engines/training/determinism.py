"""`--deterministic-mode` on a learner rank: ordered kernels wherever torch has them, on either backend.

The torch learner repeats without it on this machine: a one-rank learner on 2 CPU threads trained the same
recorded batches to different weights until `packed_sdpa` stopped gathering with advanced indexing (its CPU
backward sums repeated indices with atomic adds from several threads; see `attention._rows`). This flag is for
the kernels not met here, and for GPUs: `torch.use_deterministic_algorithms` routes every operation that has an
ordered twin to it, and cuBLAS gets the fixed workspace it needs to repeat its reductions.

`warn_only`: an operation with no deterministic implementation warns instead of failing the run (on CUDA,
`index_add_` is one). Megatron's own `deterministic_mode` is set from the same flag (`model_flags.py`).
"""

from __future__ import annotations

import os

import torch

# cuBLAS needs a fixed workspace to repeat its reductions; set before the first cuBLAS handle exists.
CUBLAS_WORKSPACE_CONFIG = ":4096:8"


def use_deterministic_kernels() -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
    torch.use_deterministic_algorithms(True, warn_only=True)
