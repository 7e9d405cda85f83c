"""Batch-invariant decoding on CUDA: does cuBLAS treat a row alike in every padded batch? (CPU: the twin file)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.batch_invariance import check_decoding_is_batch_invariant

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_decoding_is_batch_invariant_on_a_gpu_too(tiny_model_path: Path) -> None:
    check_decoding_is_batch_invariant(tiny_model_path, "cuda")
