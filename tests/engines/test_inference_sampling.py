"""Sampling math: which token is drawn and which log-prob is reported, per row, without a model."""

from __future__ import annotations

import pytest
import torch

from engines.inference.sampling import RowParams, inverse_cdf_sample, sample_next_tokens


def _params(
    temperatures: list[float], top_ps: list[float] | None = None, top_ks: list[int] | None = None
) -> RowParams:
    rows = len(temperatures)
    return RowParams.build(temperatures, top_ps or [1.0] * rows, top_ks or [0] * rows, torch.device("cpu"))


def _logits(rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _uniforms(rows: int) -> torch.Tensor:
    return torch.rand(rows, generator=torch.Generator().manual_seed(1))


@pytest.mark.unit
def test_greedy_rows_take_the_argmax_and_report_untempered_log_softmax() -> None:
    logits = _logits(3)
    tokens, log_probs = sample_next_tokens(logits, _params([0.0, 0.0, 0.0]), None)
    assert tokens.tolist() == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(log_probs, expected, rtol=0, atol=1e-6)


@pytest.mark.unit
def test_sampled_log_probs_are_log_softmax_of_logits_over_temperature() -> None:
    logits = _logits(4)
    temperatures = [0.3, 0.7, 1.0, 1.6]
    tokens, log_probs = sample_next_tokens(logits, _params(temperatures), _uniforms(4))
    scaled = logits / torch.tensor(temperatures)[:, None]
    expected = torch.log_softmax(scaled, -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(log_probs, expected, rtol=0, atol=1e-6)


@pytest.mark.unit
def test_mixed_batch_treats_greedy_and_sampled_rows_each_their_own_way() -> None:
    logits = _logits(2)
    tokens, log_probs = sample_next_tokens(logits, _params([0.0, 1.0]), torch.tensor([0.5, 0.999]))
    assert tokens[0] == logits[0].argmax()
    assert log_probs[0] == pytest.approx(float(torch.log_softmax(logits[0], -1)[tokens[0]]), abs=1e-6)
    assert log_probs[1] == pytest.approx(float(torch.log_softmax(logits[1], -1)[tokens[1]]), abs=1e-6)


@pytest.mark.unit
def test_top_k_only_draws_from_the_k_most_likely_and_renormalizes() -> None:
    logits = _logits(1, vocab=30).repeat(400, 1)
    tokens, log_probs = sample_next_tokens(logits, _params([1.0] * 400, top_ks=[3] * 400), _uniforms(400))
    top3 = set(logits[0].topk(3).indices.tolist())
    assert set(tokens.tolist()) <= top3
    assert len(set(tokens.tolist())) > 1
    renormalized = torch.log_softmax(logits[0, sorted(top3)], -1)
    expected = {token: float(lp) for token, lp in zip(sorted(top3), renormalized, strict=True)}
    for token, log_prob in zip(tokens.tolist(), log_probs.tolist(), strict=True):
        assert log_prob == pytest.approx(expected[token], abs=1e-5)


@pytest.mark.unit
def test_top_p_keeps_the_smallest_prefix_reaching_the_mass_and_no_more() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(300, 1)
    tokens, log_probs = sample_next_tokens(logits, _params([1.0] * 300, top_ps=[0.7] * 300), _uniforms(300))
    assert set(tokens.tolist()) == {0, 1}
    for token, log_prob in zip(tokens.tolist(), log_probs.tolist(), strict=True):
        assert log_prob == pytest.approx(float(torch.log(torch.tensor([0.5, 0.3]) / 0.8)[token]), abs=1e-6)


@pytest.mark.unit
def test_untruncated_row_beside_a_truncated_one_keeps_its_full_distribution() -> None:
    logits = _logits(2)
    params = _params([1.0, 1.0], top_ps=[1.0, 0.5], top_ks=[0, 2])
    tokens, log_probs = sample_next_tokens(logits, params, torch.tensor([0.3, 0.3]))
    assert log_probs[0] == pytest.approx(float(torch.log_softmax(logits[0], -1)[tokens[0]]), abs=1e-6)


@pytest.mark.unit
def test_inverse_cdf_never_returns_a_zero_probability_token_even_at_u_near_one() -> None:
    probs = torch.tensor([[0.2, 0.8, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]])
    largest_uniform = torch.tensor([1.0 - 2**-24, 1.0 - 2**-24])
    assert inverse_cdf_sample(probs, largest_uniform).tolist() == [1, 2]
    assert inverse_cdf_sample(probs, torch.zeros(2)).tolist() == [0, 2]


@pytest.mark.unit
def test_sampling_frequencies_follow_the_tempered_distribution() -> None:
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]])).repeat(20_000, 1)
    tokens, _ = sample_next_tokens(logits, _params([1.0] * 20_000), _uniforms(20_000))
    frequencies = torch.bincount(tokens, minlength=3).float() / 20_000
    torch.testing.assert_close(frequencies, torch.tensor([0.6, 0.3, 0.1]), rtol=0, atol=0.015)


@pytest.mark.unit
def test_sampling_without_uniforms_is_refused_when_a_row_samples() -> None:
    with pytest.raises(ValueError, match="uniforms are required"):
        sample_next_tokens(_logits(1), _params([1.0]), None)
