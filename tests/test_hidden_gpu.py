"""The CPU suite sees no GPU, also on a machine that has one (`tests/conftest.py`): on CI's machine these pass
without the conftest's help; on a GPU machine they fail without it, as 13 CPU tests did on an H100 (2026-11-27)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


@pytest.mark.unit
def test_a_cpu_test_sees_no_gpu_in_its_own_process() -> None:
    assert not torch.cuda.is_available()
    assert torch.cuda.device_count() == 0


@pytest.mark.integration
def test_a_process_a_cpu_test_starts_sees_no_gpu() -> None:
    probe = "import torch; print(torch.cuda.is_available(), torch.cuda.device_count())"
    seen = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert seen.stdout.split() == ["False", "0"], seen.stderr[-2000:]


@pytest.mark.gpu
def test_a_gpu_test_sees_the_gpu_as_it_was() -> None:
    assert torch.cuda.is_available() and torch.cuda.device_count() >= 1
    assert os.environ.get("CUDA_VISIBLE_DEVICES") != ""
