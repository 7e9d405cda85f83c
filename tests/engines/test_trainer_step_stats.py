"""A step's loss and metric sums: kept where the micro-batches computed them, read once."""

from __future__ import annotations

import math

import pytest
import torch

from engines.training.base import StepStats


@pytest.mark.unit
def test_sums_mix_tensors_and_numbers_and_keys_a_micro_batch_lacks() -> None:
    stats = StepStats()
    stats.add(torch.tensor(1.5, requires_grad=True) * 2, {"pg_loss": torch.tensor(0.25), "opd/tokens": 3.0})
    stats.add(torch.tensor(0.5), {"pg_loss": torch.tensor([0.75])})
    assert stats.loss_sum == 3.5
    assert stats.metric_sums == {"opd/tokens": 3.0, "pg_loss": 1.0}
    assert not stats.nonfinite
    stats.add(torch.tensor(float("nan")), {})
    assert stats.nonfinite and math.isnan(stats.loss_sum)  # a new micro-batch is read again


@pytest.mark.unit
def test_an_empty_rank_sums_to_nothing() -> None:
    stats = StepStats()
    assert (stats.loss_sum, stats.nonfinite, stats.metric_sums) == (0.0, False, {})
