"""`--deterministic-mode` on a learner rank: the same batches train to the same weights, bit for bit.

Without it, a one-rank learner on 2 CPU threads was measured training the same recorded batches to different
weights from run to run (the losses agree; the gradients differ in the last bits from the second or third step).
The cause is in the backward of indexing with repeated indices (packed rows that share a prompt gather its keys
once per response): its CPU kernel accumulates with atomic adds from several threads, in whatever order they
arrive. `torch.use_deterministic_algorithms` switches it, and every other such kernel, to a sorted, ordered
accumulation. With one thread the default kernels already repeat.

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
