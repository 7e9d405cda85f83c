import pytest
import torch
from policy_reference import Batch, discounted_returns, flat, last_masked, per_sample, random_batch

from policies import packing


@pytest.mark.unit
def test_per_sample_sum_and_mean_match_loops() -> None:
    batch = random_batch(0)
    values = torch.randn(batch.total, dtype=torch.float64)
    rows, masks = per_sample(values, batch), batch.masks
    sums = packing.per_sample_sum(values, batch.response_lengths, batch.loss_mask)
    means = packing.per_sample_mean(values, batch.response_lengths, batch.loss_mask)
    for i, (row, mask) in enumerate(zip(rows, masks, strict=True)):
        expected = sum(v * m for v, m in zip(row, mask, strict=True))
        assert sums[i].item() == pytest.approx(expected, abs=1e-12)
        assert means[i].item() == pytest.approx(expected / max(sum(mask), 1), abs=1e-12)


@pytest.mark.unit
def test_all_masked_sample_mean_is_zero_not_nan() -> None:
    means = packing.per_sample_mean(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1, 2]), torch.tensor([1.0, 0, 0]))
    assert means.tolist() == [1.0, 0.0]


@pytest.mark.unit
def test_zero_length_samples_are_allowed_everywhere() -> None:
    lengths = torch.tensor([2, 0, 1])
    values = torch.tensor([1.0, 2.0, 3.0])
    assert packing.per_sample_sum(values, lengths).tolist() == [3.0, 0.0, 3.0]
    assert packing.to_tokens(torch.tensor([5.0, 6.0, 7.0]), lengths).tolist() == [5.0, 5.0, 7.0]
    assert packing.last_masked_index(torch.ones(3), lengths).tolist() == [1, -1, 2]


@pytest.mark.unit
def test_pad_then_unpad_round_trips() -> None:
    batch = random_batch(1)
    values = torch.randn(batch.total, dtype=torch.float64)
    padded = packing.pad_packed(values, batch.response_lengths, pad_value=-7.0)
    assert padded.shape == (len(batch.lengths), max(batch.lengths))
    assert torch.equal(packing.unpad(padded, batch.response_lengths), values)


@pytest.mark.unit
def test_last_masked_index_matches_loop_and_falls_back_to_last_token() -> None:
    batch = random_batch(2)
    got = packing.last_masked_index(batch.loss_mask, batch.response_lengths).tolist()
    offsets = torch.cumsum(torch.tensor([0, *batch.lengths[:-1]]), 0).tolist()
    assert got == [off + last_masked(mask) for off, mask in zip(offsets, batch.masks, strict=True)]


@pytest.mark.unit
@pytest.mark.parametrize("gamma", [0.0, 0.37, 0.99, 1.0])
def test_discounted_cumsum_matches_backward_loop(gamma: float) -> None:
    lengths = torch.tensor([1, 130, 64, 0, 65, 7])  # crosses the 64-wide chunk boundaries
    values = torch.randn(int(lengths.sum()), dtype=torch.float64)
    got = packing.discounted_cumsum(values, lengths, gamma)
    rows = per_sample(values, _lengths_batch(lengths))
    expected = flat([discounted_returns(row, gamma) for row in rows])
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.unit
def test_group_index_maps_arbitrary_ids_to_dense_groups() -> None:
    inverse, n_groups = packing.group_index(torch.tensor([42, 7, 42, 1000, 7]))
    assert n_groups == 3
    assert inverse[0] == inverse[2] and inverse[1] == inverse[4] and len(set(inverse.tolist())) == 3


@pytest.mark.unit
def test_packed_shape_mismatch_names_the_input() -> None:
    with pytest.raises(ValueError, match=r"log_probs: expected a packed 1-D tensor of 5 tokens"):
        packing.check_packed("log_probs", torch.zeros(4), torch.tensor([2, 3]))


@pytest.mark.unit
def test_non_finite_check_names_input_and_index_but_ignores_masked_positions() -> None:
    values = torch.tensor([0.0, float("nan"), 1.0])
    packing.check_finite("rewards", values, mask=torch.tensor([1.0, 0.0, 1.0]))
    with pytest.raises(ValueError, match=r"rewards: non-finite value nan at index 1"):
        packing.check_finite("rewards", values)


@pytest.mark.unit
def test_bad_response_lengths_are_rejected_with_reason() -> None:
    with pytest.raises(ValueError, match="negative length at sample 1"):
        packing.check_lengths(torch.tensor([3, -1]))
    with pytest.raises(ValueError, match="integer tensor"):
        packing.check_lengths(torch.tensor([3.0]))


@pytest.mark.unit
def test_low_precision_inputs_are_computed_in_float32() -> None:
    assert packing.as_compute_dtype(torch.zeros(2, dtype=torch.bfloat16)).dtype == torch.float32
    assert packing.as_compute_dtype(torch.zeros(2, dtype=torch.float64)).dtype == torch.float64


def _lengths_batch(lengths: torch.Tensor) -> Batch:
    return Batch(lengths=lengths.tolist(), masks=[[1.0] * n for n in lengths.tolist()], groups=[0] * len(lengths))
