"""What the trainer tests share: one seeded batch, and small losses that divide by counts of the whole step
(known before it starts)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engines.training.base import ModelOutputs, PackedBatch, TrainSample


@dataclass(frozen=True)
class AdvantageLoss:
    """-A * log p summed over the step's response tokens, divided by their count (known before the step)."""

    tokens: int

    def __call__(self, outputs: ModelOutputs, batch: PackedBatch) -> tuple[Tensor, dict]:
        assert batch.advantages is not None
        return -(batch.advantages * outputs.log_probs).sum() / self.tokens, {}


def loss_fn(samples: list[TrainSample]) -> AdvantageLoss:
    return AdvantageLoss(tokens=sum(s.response_length for s in samples))


@dataclass(frozen=True)
class StepLoss:
    """Token-mean, sequence-mean and entropy terms, each divided by the whole step's counts (known up front)."""

    loss_tokens: int
    sequences: int

    def __call__(self, outputs: ModelOutputs, batch: PackedBatch) -> tuple[Tensor, dict]:
        assert batch.loss_mask is not None and batch.advantages is not None and outputs.entropy is not None
        mask = batch.loss_mask
        token_term = -(batch.advantages * outputs.log_probs * mask).sum() / self.loss_tokens
        sequence_term = (outputs.log_probs * mask).sum() / self.sequences
        entropy_term = (outputs.entropy * mask).sum() / self.loss_tokens
        return token_term + 0.05 * sequence_term - 0.01 * entropy_term, {"token_term": float(token_term.detach())}


def step_loss(batch: list[TrainSample]) -> StepLoss:
    return StepLoss(loss_tokens=sum(int((s.loss_mask != 0).sum()) for s in batch), sequences=len(batch))


def seeded_batch() -> list[TrainSample]:
    """Seven samples of mixed lengths with a sparse loss mask and random advantages, identical on every call."""
    generator = torch.Generator().manual_seed(3)
    batch = []
    for _ in range(7):
        length = int(torch.randint(5, 40, (1,), generator=generator))
        response = int(torch.randint(1, length, (1,), generator=generator))
        mask = (torch.rand(response, generator=generator) > 0.3).float()
        tokens = torch.randint(6, 100, (length,), generator=generator)
        advantages = torch.randn(response, generator=generator)
        batch.append(TrainSample(tokens, response, loss_mask=mask, advantages=advantages))
    return batch


def random_samples(seed: int, count: int = 4) -> list[TrainSample]:
    """`count` samples of 6-29 tokens, random responses and advantages, the same for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(count):
        length = int(torch.randint(6, 30, (1,), generator=generator))
        response = int(torch.randint(1, length, (1,), generator=generator))
        tokens = torch.randint(6, 100, (length,), generator=generator)
        samples.append(TrainSample(tokens, response, advantages=torch.randn(response, generator=generator)))
    return samples


def half_response_samples(lengths: tuple[int, ...] = (12, 30, 7, 21)) -> list[TrainSample]:
    """One sample per length, its second half the response; the same on every call."""
    generator = torch.Generator().manual_seed(0)
    samples = []
    for length in lengths:
        response = length // 2
        tokens = torch.randint(6, 100, (length,), generator=generator)
        samples.append(TrainSample(tokens, response, advantages=torch.randn(response, generator=generator)))
    return samples
