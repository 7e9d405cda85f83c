import math

import pytest
import torch
from policy_reference import kl

from policies.kl import compute_kl


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_estimators_match_scalar_formulas(kind: str) -> None:
    log_probs = torch.randn(50, dtype=torch.float64) * 3 - 2
    ref = torch.randn(50, dtype=torch.float64) * 3 - 2
    got = compute_kl(kind, log_probs, ref)
    expected = torch.tensor(
        [kl(kind, a, b) for a, b in zip(log_probs.tolist(), ref.tolist(), strict=True)], dtype=torch.float64
    )
    torch.testing.assert_close(got, expected.double(), rtol=1e-12, atol=1e-12)


@pytest.mark.unit
def test_low_var_kl_is_clamped_at_ten() -> None:
    value = compute_kl("low_var_kl", torch.tensor([0.0]), torch.tensor([20.0]))
    assert value.item() == 10.0
    assert compute_kl("k3", torch.tensor([0.0]), torch.tensor([20.0])).item() > 1e8


@pytest.mark.unit
def test_k3_is_an_unbiased_estimate_of_the_true_kl() -> None:
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(6, generator=gen, dtype=torch.float64), 0)
    q = torch.softmax(torch.randn(6, generator=gen, dtype=torch.float64), 0)
    samples = torch.multinomial(p, 200_000, replacement=True, generator=gen)
    estimate = compute_kl("k3", p.log()[samples], q.log()[samples]).mean().item()
    exact = (p * (p.log() - q.log())).sum().item()
    assert estimate == pytest.approx(exact, rel=0.03)


@pytest.mark.unit
def test_importance_ratio_multiplies_the_estimate() -> None:
    log_probs, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    ratio = torch.tensor([2.0, 0.5])
    weighted = compute_kl("k2", log_probs, ref, importance_ratio=ratio)
    torch.testing.assert_close(weighted, ratio * compute_kl("k2", log_probs, ref))


@pytest.mark.unit
def test_unknown_kl_type_lists_the_registered_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown KL estimator 'k4'; registered: k1, k2, k3, low_var_kl"):
        compute_kl("k4", torch.zeros(1), torch.zeros(1))
    assert math.isfinite(compute_kl("k1", torch.zeros(1), torch.zeros(1)).item())
