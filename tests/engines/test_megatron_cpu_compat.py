"""The CPU path keeps megatron's console quiet where megatron's warning cannot apply."""

from __future__ import annotations

import logging

import pytest
import torch

from engines.megatron.cpu_compat import cpu_compat, cuda_is_missing

pytest.importorskip("megatron.core")


@pytest.mark.unit
@pytest.mark.skipif(not cuda_is_missing(), reason="the CPU path: never taken where CUDA is")
def test_forking_the_rng_tracker_on_the_cpu_logs_no_generator_warning(
    megatron_world: None, caplog: pytest.LogCaptureFixture
) -> None:
    """The tracker's forked generator is the CPU one here, so megatron would warn on every fork that draws."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    logger = logging.getLogger("megatron.core.tensor_parallel.random")
    with caplog.at_level(logging.WARNING), cpu_compat():
        for _ in range(3):
            with get_cuda_rng_tracker().fork():
                torch.rand(4)
        logger.warning("another megatron warning")
    messages = [record.getMessage() for record in caplog.records if record.name == logger.name]
    assert messages == ["another megatron warning"]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        logger.warning("CPU RNG state changed within GPU RNG context")  # outside the CPU path: megatron's own
    assert [record.getMessage() for record in caplog.records] == ["CPU RNG state changed within GPU RNG context"]
