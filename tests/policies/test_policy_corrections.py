import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from policy_reference import Batch, aggregate, packed_random, per_sample, ppo_token_loss, random_batch

from policies.config import PolicyLossConfig
from policies.corrections import CorrectionResult
from policies.losses import compute_policy_loss


def _inputs(batch: Batch, seed: int, mismatch: float = 0.6) -> dict[str, torch.Tensor]:
    old = packed_random(batch, seed, 0.5, -1.5)
    return {
        "log_probs": (old + packed_random(batch, seed + 1, 0.2)).requires_grad_(),
        "old_log_probs": old,
        "rollout_log_probs": old + packed_random(batch, seed + 2, mismatch),
        "advantages": packed_random(batch, seed + 3),
        "loss_mask": batch.loss_mask,
        "response_lengths": batch.response_lengths,
    }


def _ppo_rows(batch: Batch, inputs: dict, eps: float = 0.2) -> list[list[float]]:
    rows = [per_sample(inputs[k].detach(), batch) for k in ("log_probs", "old_log_probs", "advantages")]
    return [
        [ppo_token_loss(a, b, c, eps, eps, None)[0] for a, b, c in zip(lp, old, adv, strict=True)]
        for lp, old, adv in zip(*rows, strict=True)
    ]


def _log_w_rows(batch: Batch, inputs: dict) -> list[list[float]]:
    return per_sample((inputs["old_log_probs"] - inputs["rollout_log_probs"]).detach(), batch)


def _masked_sum(row: list[float], mask: list[float]) -> float:
    return sum(x * m for x, m in zip(row, mask, strict=True))


@pytest.mark.unit
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_tis_weights_the_ppo_loss_by_clamped_behaviour_ratio(level: str) -> None:
    batch = random_batch(90)
    inputs = _inputs(batch, 91, mismatch=0.3)
    config = PolicyLossConfig(off_policy_correction="tis", tis_level=level, tis_clip=1.1, tis_clip_low=0.9)
    loss, metrics = compute_policy_loss(config, **inputs)
    weighted, clipped = [], []
    for ppo_row, log_w, mask in zip(_ppo_rows(batch, inputs), _log_w_rows(batch, inputs), batch.masks, strict=True):
        if level == "token":
            raw = [math.exp(x) for x in log_w]
        else:
            total = _masked_sum(log_w, mask)
            seq = total if level == "sequence" else total / max(sum(mask), 1)
            raw = [math.exp(seq)] * len(log_w)
        weighted.append([min(max(w, 0.9), 1.1) * x for w, x in zip(raw, ppo_row, strict=True)])
        clipped.append([float(not 0.9 <= w <= 1.1) for w in raw])
    assert loss.item() == pytest.approx(aggregate(weighted, batch.masks, "seq-mean-token-mean"), abs=1e-10)
    assert metrics["is_clipfrac"] == pytest.approx(aggregate(clipped, batch.masks, "token-mean"), abs=1e-12)
    assert metrics["is_clipfrac"] > 0


@pytest.mark.unit
@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    eps=st.floats(0.01, 0.5),
    level=st.sampled_from(["token", "sequence", "geometric"]),
    mode=st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]),
)
def test_tis_with_behaviour_equal_to_proximal_is_the_plain_ppo_loss(
    seed: int, eps: float, level: str, mode: str
) -> None:
    batch = random_batch(seed)
    inputs = _inputs(batch, seed)
    inputs["rollout_log_probs"] = inputs["old_log_probs"]
    plain, _ = compute_policy_loss(PolicyLossConfig(eps_clip=eps, loss_agg_mode=mode), **inputs)
    tis_config = PolicyLossConfig(eps_clip=eps, loss_agg_mode=mode, off_policy_correction="tis", tis_level=level)
    corrected, metrics = compute_policy_loss(tis_config, **inputs)
    assert corrected.item() == pytest.approx(plain.item(), abs=1e-12)
    assert metrics["is_clipfrac"] == 0.0 and metrics["is_weight_abs_dev"] == 0.0


@pytest.mark.unit
def test_decoupled_behaviour_weight_is_detached_from_the_graph() -> None:
    batch = random_batch(92)
    inputs = _inputs(batch, 93, mismatch=0.3)
    old = inputs["old_log_probs"].clone().requires_grad_()
    rollout = inputs["rollout_log_probs"].clone().requires_grad_()
    config = PolicyLossConfig(off_policy_correction="tis", loss_agg_mode="token-mean")
    loss, _ = compute_policy_loss(config, **{**inputs, "old_log_probs": old, "rollout_log_probs": rollout})
    loss.backward()
    assert old.grad is None and rollout.grad is None
    # d loss / d log pi_t = w_t * d(ppo_t)/d log pi_t / N: the weight scales the gradient as a constant
    w = (inputs["old_log_probs"] - inputs["rollout_log_probs"]).exp().clamp(0.0, 2.0)
    ratio = (inputs["log_probs"].detach() - inputs["old_log_probs"]).exp()
    adv = inputs["advantages"]
    unclipped = ((adv >= 0) & (ratio <= 1.2)) | ((adv < 0) & (ratio >= 0.8))
    expected = torch.where(unclipped, -w * ratio * adv, torch.zeros_like(w)) * batch.loss_mask / batch.loss_mask.sum()
    torch.testing.assert_close(inputs["log_probs"].grad, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.unit
def test_mis_token_level_rejects_tokens_out_of_band_and_removes_them_from_the_denominator() -> None:
    batch = random_batch(94)
    inputs = _inputs(batch, 95)
    config = PolicyLossConfig(off_policy_correction="mis", mis_upper_bound=1.5, mis_lower_bound=0.6)
    loss, metrics = compute_policy_loss(config, **inputs)
    kept_masks, weighted = [], []
    for ppo_row, log_w, mask in zip(_ppo_rows(batch, inputs), _log_w_rows(batch, inputs), batch.masks, strict=True):
        keep = [m if 0.6 <= math.exp(x) <= 1.5 else 0.0 for x, m in zip(log_w, mask, strict=True)]
        kept_masks.append(keep)
        weighted.append([math.exp(x) * p for x, p in zip(log_w, ppo_row, strict=True)])
    assert loss.item() == pytest.approx(aggregate(weighted, kept_masks, "seq-mean-token-mean"), abs=1e-10)
    rejected = sum(batch.loss_mask.tolist()) - sum(sum(k) for k in kept_masks)
    assert metrics["num_rejected_tokens"] == rejected > 0
    assert metrics["is_maskfrac"] == pytest.approx(rejected / batch.loss_mask.sum().item())


@pytest.mark.unit
@pytest.mark.parametrize(("level", "low", "high"), [("sequence", 0.8, 1.3), ("geometric", 0.95, 1.05)])
def test_mis_sequence_levels_reject_whole_sequences(level: str, low: float, high: float) -> None:
    batch = random_batch(96, n_groups=6)
    inputs = _inputs(batch, 97, mismatch=0.15)
    config = PolicyLossConfig(off_policy_correction="mis", mis_level=level, mis_upper_bound=high, mis_lower_bound=low)
    loss, _ = compute_policy_loss(config, **inputs)
    kept_masks, weighted, n_rejected = [], [], 0
    for ppo_row, log_w, mask in zip(_ppo_rows(batch, inputs), _log_w_rows(batch, inputs), batch.masks, strict=True):
        total = _masked_sum(log_w, mask)
        seq_w = math.exp(total if level == "sequence" else total / max(sum(mask), 1))
        keep = low <= seq_w <= high
        n_rejected += (not keep) and sum(mask) > 0
        kept_masks.append([m * keep for m in mask])
        weighted.append([seq_w * p for p in ppo_row])
    assert n_rejected > 0
    assert loss.item() == pytest.approx(aggregate(weighted, kept_masks, "seq-mean-token-mean"), abs=1e-10)


@pytest.mark.unit
def test_mis_veto_rejects_a_sequence_holding_one_near_impossible_token() -> None:
    lengths = torch.tensor([3, 3])
    old = torch.zeros(6, dtype=torch.float64)
    rollout = torch.zeros(6, dtype=torch.float64)
    rollout[1] = 12.0  # pi_old / mu = e^-12 < 1e-4 at one token of sample 0
    config = PolicyLossConfig(
        off_policy_correction="mis", mis_upper_bound=1e9, mis_lower_bound=0.0, mis_veto_threshold=1e-4
    )
    loss, metrics = compute_policy_loss(
        config,
        log_probs=old.clone().requires_grad_(),
        old_log_probs=old,
        rollout_log_probs=rollout,
        advantages=torch.tensor([1.0, 1, 1, 2, 2, 2], dtype=torch.float64),
        loss_mask=torch.ones(6),
        response_lengths=lengths,
    )
    assert metrics["is_veto_seqfrac"] == 0.5
    assert metrics["num_rejected_tokens"] == 3
    assert loss.item() == pytest.approx(-2.0)  # only sample 1 remains: ratio 1, advantage 2


@pytest.mark.unit
def test_icepop_zeroes_out_of_band_tokens_but_keeps_them_in_the_denominator() -> None:
    batch = random_batch(98)
    inputs = _inputs(batch, 99)
    config = PolicyLossConfig(
        off_policy_correction="icepop", tis_clip_low=0.5, tis_clip=2.0, loss_agg_mode="token-mean"
    )
    loss, metrics = compute_policy_loss(config, **inputs)
    weighted, outside = [], []
    for ppo_row, log_w in zip(_ppo_rows(batch, inputs), _log_w_rows(batch, inputs), strict=True):
        weights = [math.exp(x) if 0.5 <= math.exp(x) <= 2.0 else 0.0 for x in log_w]
        weighted.append([w * p for w, p in zip(weights, ppo_row, strict=True)])
        outside.append([float(w == 0.0) for w in weights])
    assert loss.item() == pytest.approx(aggregate(weighted, batch.masks, "token-mean"), abs=1e-10)
    assert metrics["is_maskfrac"] == pytest.approx(aggregate(outside, batch.masks, "token-mean"))
    assert metrics["is_maskfrac"] > 0
    assert metrics["num_rejected_tokens"] == 0


@pytest.mark.unit
def test_opsm_masks_negative_advantage_sequences_that_drifted_from_behaviour() -> None:
    lengths = torch.tensor([2, 2, 2])
    log_probs = torch.zeros(6, dtype=torch.float64, requires_grad=True)
    rollout = torch.tensor([0.5, 0.5, 0.5, 0.5, 0.0, 0.0], dtype=torch.float64)  # samples 0, 1 drifted (KL 0.5)
    advantages = torch.tensor([-1.0, -1.0, 1.0, 1.0, -1.0, -1.0], dtype=torch.float64)
    config = PolicyLossConfig(off_policy_correction="none", use_opsm=True, opsm_delta=0.1,
                              loss_agg_mode="seq-mean-token-mean")
    loss, metrics = compute_policy_loss(
        config,
        log_probs=log_probs,
        old_log_probs=torch.zeros(6, dtype=torch.float64),
        rollout_log_probs=rollout,
        advantages=advantages,
        loss_mask=torch.ones(6),
        response_lengths=lengths,
    )
    assert metrics["opsm_seqfrac"] == pytest.approx(1 / 3)  # only sample 0: negative AND drifted
    assert loss.item() == pytest.approx((0.0 + -1.0 + 1.0) / 3)  # masked sequence keeps its denominator slot


@pytest.mark.unit
def test_mismatch_metrics_report_weight_deviation_and_log_prob_gap() -> None:
    batch = random_batch(100)
    inputs = _inputs(batch, 101)
    _, metrics = compute_policy_loss(PolicyLossConfig(), **inputs)
    trained = batch.loss_mask > 0
    log_w = (inputs["old_log_probs"] - inputs["rollout_log_probs"])[trained]
    assert metrics["train_rollout_logprob_abs_diff"] == pytest.approx(log_w.abs().mean().item())
    assert metrics["is_weight_abs_dev"] == pytest.approx((log_w.exp() - 1).abs().mean().item())


@pytest.mark.unit
def test_correction_without_rollout_log_probs_is_a_clear_error() -> None:
    batch = random_batch(102)
    inputs = {**_inputs(batch, 103), "rollout_log_probs": None}
    with pytest.raises(ValueError, match="off_policy_correction='tis' needs rollout_log_probs"):
        compute_policy_loss(PolicyLossConfig(off_policy_correction="tis"), **inputs)


def halve_everything(
    config: PolicyLossConfig,
    *,
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    loss_mask: torch.Tensor,
    response_lengths: torch.Tensor,
) -> CorrectionResult:
    """A user correction plugged in by dotted path (this module is importable from the tests folder)."""
    return CorrectionResult(weights=torch.full_like(loss_mask, 0.5), keep_mask=torch.ones_like(loss_mask))


@pytest.mark.unit
def test_user_correction_is_selected_by_dotted_path() -> None:
    batch = random_batch(104)
    inputs = _inputs(batch, 105)
    plain, _ = compute_policy_loss(PolicyLossConfig(off_policy_correction="none"), **inputs)
    custom = PolicyLossConfig(off_policy_correction="test_policy_corrections:halve_everything")
    halved, _ = compute_policy_loss(custom, **inputs)
    assert halved.item() == pytest.approx(plain.item() / 2, abs=1e-14)
