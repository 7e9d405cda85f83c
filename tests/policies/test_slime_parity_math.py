"""The settings that give slime's RL math where ours differs on purpose (docs/policies.md, "Where we differ from
slime"), and slime's conventions we adopted as defaults. Numbers are worked out by hand; no slime code is used."""

import math

import pytest
import torch

from policies.advantages import compute_advantages, whiten
from policies.aggregation import aggregate, global_denominator
from policies.config import PolicyLossConfig
from policies.corrections import opsm_keep_mask
from policies.kl import compute_kl
from policies.losses import PolicyLossInputs, compute_policy_loss, effective_loss_mask, ppo_loss

D = torch.float64


def _ppo_single_token(config: PolicyLossConfig, log_ratio: float, advantage: float) -> float:
    inputs = PolicyLossInputs(
        log_probs=torch.tensor([log_ratio], dtype=D),
        old_log_probs=torch.tensor([0.0], dtype=D),
        advantages=torch.tensor([advantage], dtype=D),
        loss_mask=torch.tensor([1.0], dtype=D),
        response_lengths=torch.tensor([1]),
    )
    return float(ppo_loss(config, inputs).per_token_loss[0])


@pytest.mark.unit
def test_log_ratio_is_clamped_at_20_by_default_and_not_at_all_with_slime_setting() -> None:
    # A negative advantage leaves the ratio unclipped above, so the loss is -ratio * A = exp(25).
    assert _ppo_single_token(PolicyLossConfig(), 25.0, -1.0) == pytest.approx(math.exp(20.0))
    assert _ppo_single_token(PolicyLossConfig(log_ratio_clamp=None), 25.0, -1.0) == pytest.approx(math.exp(25.0))


@pytest.mark.unit
def test_whitening_uses_the_unbiased_variance_like_slime() -> None:
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 99.0], dtype=D)
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0], dtype=D)
    # mean 2.5, sum of squares 5: unbiased variance 5/3, population variance 5/4.
    expected = torch.tensor([-1.5, -0.5, 0.5, 1.5, 0.0], dtype=D)
    torch.testing.assert_close(whiten(values, mask), expected / math.sqrt(5 / 3 + 1e-8))
    torch.testing.assert_close(whiten(values, mask, unbiased=False), expected / math.sqrt(5 / 4 + 1e-8))


@pytest.mark.unit
def test_opsm_masks_each_negative_advantage_token_of_an_off_policy_sequence() -> None:
    # One off-policy sequence (mean log mu - log pi = 1 > delta) with advantages [+1, -1, +0.5]: per token, only the
    # negative one is masked; by the sequence's mean advantage (+1/6 >= 0), nothing is.
    common = dict(
        advantages=torch.tensor([1.0, -1.0, 0.5], dtype=D),
        log_probs=torch.tensor([-2.0, -2.0, -2.0], dtype=D),
        rollout_log_probs=torch.tensor([-1.0, -1.0, -1.0], dtype=D),
        loss_mask=torch.ones(3, dtype=D),
        response_lengths=torch.tensor([3]),
        delta=0.5,
    )
    keep, fraction = opsm_keep_mask(**common)
    torch.testing.assert_close(keep, torch.tensor([1.0, 0.0, 1.0], dtype=D))
    assert float(fraction) == 1.0
    keep, fraction = opsm_keep_mask(**common, per_token=False)
    torch.testing.assert_close(keep, torch.ones(3, dtype=D))
    assert float(fraction) == 0.0
    assert PolicyLossConfig().opsm_token_advantage is True


@pytest.mark.unit
def test_opsm_reference_old_reads_the_learners_pi_old_instead_of_the_engines_log_probs() -> None:
    # pi_old equals pi_theta (no KL), the engine's log-probs are far off: only the 'rollout' reference masks.
    base = dict(
        log_probs=torch.tensor([-2.0, -2.0], dtype=D),
        old_log_probs=torch.tensor([-2.0, -2.0], dtype=D),
        rollout_log_probs=torch.tensor([-1.0, -1.0], dtype=D),
        advantages=torch.tensor([-1.0, -1.0], dtype=D),
        loss_mask=torch.ones(2, dtype=D),
        response_lengths=torch.tensor([2]),
    )
    opsm = {"off_policy_correction": "none", "use_opsm": True, "opsm_delta": 0.5}
    _, by_rollout = compute_policy_loss(PolicyLossConfig(**opsm), **base)
    _, by_old = compute_policy_loss(PolicyLossConfig(**opsm, opsm_reference="old"), **base)
    assert by_rollout["pg_loss"] == 0.0 and by_rollout["opsm_seqfrac"] == 1.0
    assert by_old["pg_loss"] == pytest.approx(1.0) and by_old["opsm_seqfrac"] == 0.0


@pytest.mark.unit
def test_gae_untrained_tail_keep_penalises_every_token_and_rewards_the_last() -> None:
    # One response of 3 tokens, the last untrained; k1 KL per token = [0.1, 0.2, 0.4]; kl_coef 1, reward 1,
    # values 0, gamma = lambd = 1, so the first token's advantage is the sum of the token rewards.
    kwargs = dict(
        rewards=torch.tensor([1.0], dtype=D),
        group_ids=torch.tensor([0]),
        response_lengths=torch.tensor([3]),
        loss_mask=torch.tensor([1.0, 1.0, 0.0], dtype=D),
        values=torch.zeros(3, dtype=D),
        log_probs=torch.tensor([0.1, 0.2, 0.4], dtype=D),
        ref_log_probs=torch.zeros(3, dtype=D),
    )
    skip, _ = compute_advantages(PolicyLossConfig(advantage_estimator="ppo", kl_coef=1.0), **kwargs)
    keep, _ = compute_advantages(
        PolicyLossConfig(advantage_estimator="ppo", kl_coef=1.0, untrained_token_rewards="keep"), **kwargs
    )
    torch.testing.assert_close(skip, torch.tensor([1 - 0.3, 1 - 0.2, 0.0], dtype=D))
    torch.testing.assert_close(keep, torch.tensor([1 - 0.7, 1 - 0.6, 0.0], dtype=D))


@pytest.mark.unit
def test_count_empty_samples_gives_slimes_denominators() -> None:
    per_token = torch.tensor([1.0, 3.0, 5.0, 7.0], dtype=D)
    mask = torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=D)  # the second sample is entirely masked
    lengths = torch.tensor([2, 2])
    assert float(aggregate(per_token, mask, lengths, "token-mean")) == pytest.approx(4 / 2)
    assert float(aggregate(per_token, mask, lengths, "token-mean", count_empty_samples=True)) == pytest.approx(4 / 3)
    assert float(aggregate(per_token, mask, lengths, "seq-mean-token-mean")) == pytest.approx(2.0)
    slime_seq = aggregate(per_token, mask, lengths, "seq-mean-token-mean", count_empty_samples=True)
    assert float(slime_seq) == pytest.approx(1.0)
    assert global_denominator("token-mean", mask, lengths, count_empty_samples=True) == 3.0
    assert global_denominator("seq-mean-token-sum", mask, lengths, count_empty_samples=True) == 2.0
    assert global_denominator("seq-mean-token-sum", mask, lengths) == 1.0


@pytest.mark.unit
def test_rejected_tokens_stay_in_the_denominator_with_slime_setting() -> None:
    # Ratio 1, advantage 1 (per-token loss -1); MIS rejects the third token (w = e^2 > 2).
    base = dict(
        log_probs=torch.zeros(3, dtype=D),
        old_log_probs=torch.zeros(3, dtype=D),
        rollout_log_probs=torch.tensor([0.0, 0.0, -2.0], dtype=D),
        advantages=torch.ones(3, dtype=D),
        loss_mask=torch.ones(3, dtype=D),
        response_lengths=torch.tensor([3]),
    )
    ours = PolicyLossConfig(off_policy_correction="mis", loss_agg_mode="token-mean")
    slime = PolicyLossConfig(
        off_policy_correction="mis", loss_agg_mode="token-mean", rejected_tokens_in_denominator=True
    )
    assert compute_policy_loss(ours, **base)[1]["pg_loss"] == pytest.approx(-2 / 2)
    assert compute_policy_loss(slime, **base)[1]["pg_loss"] == pytest.approx(-2 / 3)
    keep_kwargs = {k: base[k] for k in ("loss_mask", "response_lengths", "old_log_probs", "rollout_log_probs")}
    torch.testing.assert_close(effective_loss_mask(ours, **keep_kwargs), torch.tensor([1.0, 1.0, 0.0], dtype=D))
    torch.testing.assert_close(effective_loss_mask(slime, **keep_kwargs), torch.ones(3, dtype=D))


@pytest.mark.unit
def test_low_var_kl_clamp_after_the_importance_weight_with_slime_setting() -> None:
    # ref - log pi = 3: k3 = e^3 - 4 = 16.09 -> 10 when clamped first; weighted by 0.5 -> 5, or 8.04 then clamped.
    log_probs, ref = torch.tensor([0.0], dtype=D), torch.tensor([3.0], dtype=D)
    weight = torch.tensor([0.5], dtype=D)
    before = compute_kl("low_var_kl", log_probs, ref, importance_ratio=weight)
    after = compute_kl("low_var_kl", log_probs, ref, importance_ratio=weight, clamp_after_weight=True)
    assert float(before) == pytest.approx(5.0)
    assert float(after) == pytest.approx(0.5 * (math.exp(3) - 4))
