"""Packing: micro-batch planning, the packed row layout, collation and the isolation check."""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch import nn

from engines.training.base import TrainSample
from engines.training.micro_batches import (
    check_packing_isolation,
    collate,
    count_loss_tokens,
    pack_inputs,
    padded_fraction,
    plan_micro_batches,
)
from tools.standins.tiny_model import TinyModelSpec, build_tiny_model, build_tokenizer


def _sample(length: int, response: int, seed: int = 0, **fields: torch.Tensor | float) -> TrainSample:
    tokens = torch.randint(6, 100, (length,), generator=torch.Generator().manual_seed(seed))
    return TrainSample(tokens=tokens, response_length=response, **fields)


@pytest.mark.unit
def test_plan_places_every_sample_once_within_the_budget() -> None:
    lengths = [random.Random(seed).randint(1, 90) for seed in range(200)]
    plan = plan_micro_batches(lengths, token_budget=128)
    assert sorted(index for members in plan for index in members) == list(range(200))
    assert all(sum(lengths[i] for i in members) <= 128 for members in plan)


@pytest.mark.unit
def test_plan_gives_an_oversized_sample_its_own_micro_batch() -> None:
    plan = plan_micro_batches([10, 500, 20], token_budget=100)
    assert [1] in plan
    assert sorted(index for members in plan for index in members) == [0, 1, 2]


@pytest.mark.unit
@pytest.mark.parametrize(("samples", "budget"), [(64, 4096), (2000, 8192)])
def test_plan_uses_few_micro_batches_and_spreads_tokens_evenly(samples: int, budget: int) -> None:
    rng = random.Random(0)
    lengths = [min(2048, int(rng.lognormvariate(5.0, 1.0)) + 1) for _ in range(samples)]
    plan = plan_micro_batches(lengths, token_budget=budget)
    assert len(plan) <= math.ceil(sum(lengths) / budget) + 1
    assert padded_fraction(lengths, plan) < 0.05


@pytest.mark.unit
def test_packed_row_restarts_positions_and_points_at_response_tokens() -> None:
    first, second = _sample(5, 2, seed=1), _sample(4, 3, seed=2)
    inputs = pack_inputs([first, second])
    assert inputs.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]
    assert torch.equal(inputs.input_ids[0], torch.cat([first.tokens, second.tokens]))
    # logits at position p predict token p + 1
    assert torch.equal(inputs.input_ids[0][inputs.logit_positions + 1], inputs.targets)
    assert torch.equal(inputs.targets, torch.cat([first.tokens[-2:], second.tokens[-3:]]))


@pytest.mark.unit
def test_zero_length_response_contributes_no_positions() -> None:
    inputs = pack_inputs([_sample(4, 0), _sample(3, 2)])
    assert inputs.response_lengths.tolist() == [0, 2]
    assert inputs.logit_positions.tolist() == [4, 5]  # row positions 5 and 6 hold the response


@pytest.mark.unit
def test_collate_concatenates_token_fields_and_leaves_rewards_to_the_advantages() -> None:
    first = _sample(5, 2, advantages=torch.tensor([1.0, 2.0]), reward=0.5)
    second = _sample(4, 1, advantages=torch.tensor([3.0]), reward=None)  # a reward is no token field: may differ
    batch = collate([first, second])
    assert batch.advantages is not None
    assert batch.advantages.tolist() == [1.0, 2.0, 3.0]
    assert set(batch.tensors()) == {"response_lengths", "advantages"}  # no loss reads rewards: none is packed
    assert batch.loss_mask is None and batch.old_log_probs is None  # absent fields stay absent
    assert batch.sample_index().tolist() == [0, 0, 1]


@pytest.mark.unit
def test_collate_names_the_sample_whose_fields_differ() -> None:
    first = _sample(5, 2, advantages=torch.zeros(2))
    second = _sample(4, 1)
    with pytest.raises(ValueError, match=r"sample 1: fields differ.*missing \['advantages'\]"):
        collate([first, second])


@pytest.mark.unit
def test_loss_tokens_count_only_unmasked_response_tokens() -> None:
    masked = _sample(6, 3, loss_mask=torch.tensor([1.0, 0.0, 1.0]))
    unmasked = _sample(5, 4)
    assert count_loss_tokens([masked, unmasked]) == 2 + 4


@pytest.mark.unit
@pytest.mark.parametrize(
    ("response_length", "field_length", "message"),
    [(5, 5, "response_length 5 must be in"), (2, 3, "token field 'advantages' must be a 1-D tensor of")],
)
def test_invalid_sample_is_named(response_length: int, field_length: int, message: str) -> None:
    sample = TrainSample(torch.arange(5), response_length, advantages=torch.zeros(field_length))
    with pytest.raises(ValueError, match=f"sample 7: {message}"):
        sample.validate(7)


class _AlwaysMasked(nn.Module):
    """A real HF model driven with an explicit all-ones attention mask, which disables packed-sequence
    detection: the shape of bug the isolation check exists to catch."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.config = model.config

    def get_output_embeddings(self) -> nn.Module:
        return self.model.get_output_embeddings()

    def forward(self, input_ids: torch.Tensor, **kwargs: object) -> object:
        return self.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)


@pytest.mark.unit
def test_isolation_check_passes_for_hf_models_and_fails_when_sequences_leak() -> None:
    model = build_tiny_model(TinyModelSpec(family="llama"), build_tokenizer()).eval()
    check_packing_isolation(model, "cpu")
    with pytest.raises(RuntimeError, match="does not isolate packed sequences"):
        check_packing_isolation(_AlwaysMasked(model), "cpu")
