import math

import pytest
import torch
from policy_reference import Batch, aggregate, kl, packed_random, per_sample, ppo_token_loss, random_batch

from policies.aggregation import global_denominator, rollout_token_denominators
from policies.config import PolicyLossConfig
from policies.losses import compute_policy_loss, compute_value_loss, effective_loss_mask

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]


def _inputs(batch: Batch, seed: int) -> dict[str, torch.Tensor]:
    old = packed_random(batch, seed, 0.5, -1.5)
    return {
        "log_probs": (old + packed_random(batch, seed + 1, 0.25)).requires_grad_(),
        "old_log_probs": old,
        "rollout_log_probs": old + packed_random(batch, seed + 2, 0.1),
        "advantages": packed_random(batch, seed + 3),
        "loss_mask": batch.loss_mask,
        "response_lengths": batch.response_lengths,
    }


def _rows(batch: Batch, tensor: torch.Tensor) -> list[list[float]]:
    return per_sample(tensor.detach(), batch)


@pytest.mark.unit
@pytest.mark.parametrize("mode", MODES)
def test_ppo_loss_with_clip_higher_and_dual_clip_matches_reference(mode: str) -> None:
    batch = random_batch(40)
    inputs = _inputs(batch, 41)
    config = PolicyLossConfig(off_policy_correction="none", eps_clip=0.1, eps_clip_high=0.3, eps_clip_c=2.0,
                              loss_agg_mode=mode)
    loss, metrics = compute_policy_loss(config, **inputs)
    per_token, clipped = [], []
    for lp, old, adv in zip(
        *(_rows(batch, inputs[k]) for k in ("log_probs", "old_log_probs", "advantages")), strict=True
    ):
        pairs = [ppo_token_loss(a, b, c, 0.1, 0.3, 2.0) for a, b, c in zip(lp, old, adv, strict=True)]
        per_token.append([p[0] for p in pairs])
        clipped.append([float(p[1]) for p in pairs])
    assert loss.item() == pytest.approx(aggregate(per_token, batch.masks, mode), abs=1e-10)
    assert metrics["pg_clipfrac"] == pytest.approx(aggregate(clipped, batch.masks, "token-mean"), abs=1e-12)
    assert metrics["pg_clipfrac"] > 0  # the test exercises clipping, not only the linear region


@pytest.mark.unit
def test_dual_clip_caps_the_loss_of_negative_advantages() -> None:
    config = PolicyLossConfig(off_policy_correction="none", eps_clip_c=3.0, loss_agg_mode="token-mean")
    ratio = 10.0  # far outside the trust region, with a negative advantage: unbounded without dual-clip
    loss, metrics = compute_policy_loss(
        config,
        log_probs=torch.tensor([math.log(ratio)]),
        old_log_probs=torch.tensor([0.0]),
        rollout_log_probs=None,
        advantages=torch.tensor([-1.0]),
        loss_mask=torch.ones(1),
        response_lengths=torch.tensor([1]),
    )
    assert loss.item() == pytest.approx(3.0)
    assert metrics["pg_dual_clipfrac"] == 1.0


def _gspo_reference_loss(
    batch: Batch, log_probs: torch.Tensor, old: torch.Tensor, seq_adv: list[float], eps: float
) -> torch.Tensor:
    """Sequence-level GSPO written directly: s_i = exp(mean_t (log pi - log pi_old)), mean over sequences."""
    total, n_seqs, start = log_probs.new_zeros(()), 0, 0
    for length, mask, adv in zip(batch.lengths, batch.masks, seq_adv, strict=True):
        m = torch.tensor(mask, dtype=torch.float64)
        if m.sum() > 0:
            s = torch.exp(((log_probs[start : start + length] - old[start : start + length]) * m).sum() / m.sum())
            total = total + torch.maximum(-s * adv, -s.clamp(1 - eps, 1 + eps) * adv)
            n_seqs += 1
        start += length
    return total / n_seqs


@pytest.mark.unit
def test_gspo_token_form_matches_sequence_level_gspo_in_value_and_gradient() -> None:
    batch = random_batch(42)
    inputs = _inputs(batch, 43)
    seq_adv = torch.randn(len(batch.lengths), dtype=torch.float64, generator=torch.Generator().manual_seed(44))
    inputs["advantages"] = torch.repeat_interleave(seq_adv, batch.response_lengths)
    config = PolicyLossConfig(off_policy_correction="none", advantage_estimator="gspo", eps_clip=0.05,
                              loss_agg_mode="seq-mean-token-mean")
    loss, metrics = compute_policy_loss(config, **inputs)
    (grad,) = torch.autograd.grad(loss, inputs["log_probs"])
    reference_lp = inputs["log_probs"].detach().clone().requires_grad_()
    reference = _gspo_reference_loss(batch, reference_lp, inputs["old_log_probs"], seq_adv.tolist(), 0.05)
    (reference_grad,) = torch.autograd.grad(reference, reference_lp)
    assert loss.item() == pytest.approx(reference.item(), abs=1e-12)
    torch.testing.assert_close(grad, reference_grad, rtol=1e-10, atol=1e-12)
    assert 0 < metrics["pg_clipfrac"] < 1  # some sequences clipped, some not


@pytest.mark.unit
def test_cispo_gradient_flows_only_through_log_prob_with_clipped_weight() -> None:
    batch = random_batch(45)
    inputs = _inputs(batch, 46)
    config = PolicyLossConfig(off_policy_correction="none",
        advantage_estimator="cispo", eps_clip=0.05, eps_clip_high=0.05, loss_agg_mode="token-mean"
    )
    loss, metrics = compute_policy_loss(config, **inputs)
    (grad,) = torch.autograd.grad(loss, inputs["log_probs"])
    n_tokens = batch.loss_mask.sum()
    ratio = (inputs["log_probs"].detach() - inputs["old_log_probs"]).exp()
    expected = -ratio.clamp(0.95, 1.05) * inputs["advantages"] * batch.loss_mask / n_tokens
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)
    assert metrics["pg_clipfrac"] > 0.5  # clipped tokens ...
    assert bool((grad[batch.loss_mask > 0] != 0).all())  # ... still carry gradient, unlike PPO


@pytest.mark.unit
def test_sft_loss_is_mean_negative_log_likelihood() -> None:
    batch = random_batch(47)
    inputs = _inputs(batch, 48)
    config = PolicyLossConfig(loss_type="sft", loss_agg_mode="token-mean")
    loss, _ = compute_policy_loss(
        config,
        log_probs=inputs["log_probs"],
        old_log_probs=None,
        rollout_log_probs=None,
        advantages=None,
        loss_mask=batch.loss_mask,
        response_lengths=batch.response_lengths,
    )
    nll = [[-x for x in row] for row in _rows(batch, inputs["log_probs"])]
    assert loss.item() == pytest.approx(aggregate(nll, batch.masks, "token-mean"), abs=1e-12)


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_loss_term_adds_coefficient_times_aggregated_kl(kind: str) -> None:
    batch = random_batch(49)
    inputs = _inputs(batch, 50)
    ref = packed_random(batch, 51, 2.0, -1.0)  # wide spread so low_var_kl's clamp is hit
    base = PolicyLossConfig(loss_agg_mode="seq-mean-token-mean")
    with_kl = PolicyLossConfig(
        loss_agg_mode="seq-mean-token-mean", use_kl_loss=True, kl_loss_coef=0.3, kl_loss_type=kind
    )
    plain, _ = compute_policy_loss(base, **inputs)
    loss, metrics = compute_policy_loss(with_kl, ref_log_probs=ref, **inputs)
    kl_rows = [
        [kl(kind, a, b) for a, b in zip(lp, rp, strict=True)]
        for lp, rp in zip(_rows(batch, inputs["log_probs"]), _rows(batch, ref), strict=True)
    ]
    expected_kl = aggregate(kl_rows, batch.masks, "seq-mean-token-mean")
    assert metrics["kl_loss"] == pytest.approx(expected_kl, abs=1e-10)
    assert loss.item() == pytest.approx(plain.item() + 0.3 * expected_kl, abs=1e-10)


@pytest.mark.unit
def test_unbiased_kl_weights_k3_by_current_over_old_ratio() -> None:
    batch = random_batch(52)
    inputs = _inputs(batch, 53)
    ref = packed_random(batch, 54, 0.5, -1.0)
    config = PolicyLossConfig(use_kl_loss=True, kl_loss_coef=1.0, kl_loss_type="k3", use_unbiased_kl=True)
    _, metrics = compute_policy_loss(config, ref_log_probs=ref, **inputs)
    rows = zip(
        _rows(batch, inputs["log_probs"]), _rows(batch, inputs["old_log_probs"]), _rows(batch, ref), strict=True
    )
    weighted = [
        [math.exp(a - o) * kl("k3", a, r) for a, o, r in zip(lp, old, rp, strict=True)] for lp, old, rp in rows
    ]
    assert metrics["kl_loss"] == pytest.approx(aggregate(weighted, batch.masks, "seq-mean-token-mean"), abs=1e-10)


@pytest.mark.unit
def test_entropy_bonus_lowers_the_loss_by_coefficient_times_entropy() -> None:
    batch = random_batch(55)
    inputs = _inputs(batch, 56)
    entropy = packed_random(batch, 57).abs()
    plain, _ = compute_policy_loss(PolicyLossConfig(), **inputs)
    loss, metrics = compute_policy_loss(PolicyLossConfig(entropy_coef=0.01), entropy=entropy, **inputs)
    expected = aggregate(_rows(batch, entropy), batch.masks, "seq-mean-token-mean")
    assert metrics["entropy_loss"] == pytest.approx(expected, abs=1e-12)
    assert loss.item() == pytest.approx(plain.item() - 0.01 * expected, abs=1e-12)


@pytest.mark.unit
def test_clipped_value_loss_matches_reference() -> None:
    batch = random_batch(58)
    values = packed_random(batch, 59).requires_grad_()
    old_values, returns = packed_random(batch, 60), packed_random(batch, 61)
    config = PolicyLossConfig(value_clip=0.2, loss_agg_mode="token-mean")
    loss, metrics = compute_value_loss(
        config,
        values=values,
        returns=returns,
        old_values=old_values,
        loss_mask=batch.loss_mask,
        response_lengths=batch.response_lengths,
    )
    per_token, clipped = [], []
    for v_row, o_row, r_row in zip(_rows(batch, values), _rows(batch, old_values), _rows(batch, returns), strict=True):
        per_token.append(
            [
                max((o + min(max(v - o, -0.2), 0.2) - r) ** 2, (v - r) ** 2)
                for v, o, r in zip(v_row, o_row, r_row, strict=True)
            ]
        )
        clipped.append([float(abs(v - o) > 0.2) for v, o in zip(v_row, o_row, strict=True)])
    assert loss.item() == pytest.approx(aggregate(per_token, batch.masks, "token-mean"), abs=1e-10)
    assert metrics["value_clipfrac"] == pytest.approx(aggregate(clipped, batch.masks, "token-mean"), abs=1e-12)


@pytest.mark.unit
def test_policy_loss_includes_value_term_when_values_are_given() -> None:
    batch = random_batch(62)
    inputs = _inputs(batch, 63)
    values, returns = packed_random(batch, 64), packed_random(batch, 65)
    config = PolicyLossConfig(advantage_estimator="ppo", value_loss_coef=0.5)
    plain, _ = compute_policy_loss(config, **inputs)
    loss, metrics = compute_policy_loss(config, values=values, returns=returns, **inputs)
    value_only, _ = compute_value_loss(
        config, values=values, returns=returns, loss_mask=batch.loss_mask, response_lengths=batch.response_lengths
    )
    assert loss.item() == pytest.approx(plain.item() + 0.5 * value_only.item(), abs=1e-12)
    assert metrics["value_loss"] == pytest.approx(value_only.item(), abs=1e-12)


def _split_batch_losses(
    config: PolicyLossConfig,
    batch: Batch,
    inputs: dict,
    chunks: list[list[int]],
    rollout_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of micro-batch losses (samples listed in ``chunks``) with global denominators, and the summed grad."""
    mask = effective_loss_mask(
        config,
        loss_mask=inputs["loss_mask"],
        response_lengths=batch.response_lengths,
        old_log_probs=inputs["old_log_probs"],
        rollout_log_probs=inputs["rollout_log_probs"],
    )
    denominator = global_denominator(config.loss_agg_mode, mask, batch.response_lengths, rollout_ids=rollout_ids)
    sample_den = None if rollout_ids is None else rollout_token_denominators(mask, batch.response_lengths, rollout_ids)
    offsets = torch.cumsum(torch.tensor([0, *batch.lengths]), 0)
    leaf = inputs["log_probs"]
    total = torch.zeros((), dtype=torch.float64)
    grad = torch.zeros_like(leaf)
    for chunk in chunks:
        tokens = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in chunk])
        part = {k: v.detach()[tokens] for k, v in inputs.items() if k not in ("response_lengths", "log_probs")}
        lp = leaf.detach()[tokens].clone().requires_grad_()
        loss, _ = compute_policy_loss(
            config,
            log_probs=lp,
            response_lengths=batch.response_lengths[chunk],
            denominator=denominator,
            sample_denominators=None if sample_den is None else sample_den[chunk],
            **part,
        )
        loss.backward()
        grad[tokens] += lp.grad
        total = total + loss.detach()
    return total, grad


@pytest.mark.unit
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("correction", ["none", "tis", "mis"])
def test_micro_batched_data_parallel_losses_sum_to_the_full_batch_loss(mode: str, correction: str) -> None:
    batch = random_batch(66, n_groups=5)
    inputs = _inputs(batch, 67)
    inputs["rollout_log_probs"] = inputs["old_log_probs"] + packed_random(batch, 68, 0.8)  # MIS rejects some
    config = PolicyLossConfig(loss_agg_mode=mode, off_policy_correction=correction, entropy_coef=0.0)
    full, _ = compute_policy_loss(config, **inputs)
    (full_grad,) = torch.autograd.grad(full, inputs["log_probs"])
    n = len(batch.lengths)
    # two "ranks", each with two micro-batches of uneven size; the sample order is shuffled across them
    order = torch.randperm(n, generator=torch.Generator().manual_seed(69)).tolist()
    chunks = [order[:2], order[2 : n // 2], order[n // 2 : n - 3], order[n - 3 :]]
    summed, summed_grad = _split_batch_losses(config, batch, inputs, chunks)
    assert summed.item() == pytest.approx(full.item(), abs=1e-12)
    torch.testing.assert_close(summed_grad, full_grad, rtol=1e-10, atol=1e-12)


@pytest.mark.unit
def test_samples_sharing_a_rollout_are_one_sequence_with_a_per_rollout_denominator() -> None:
    batch = random_batch(70, n_groups=3)
    inputs = _inputs(batch, 71)
    n = len(batch.lengths)
    rollout_ids = torch.tensor([i // 2 for i in range(n)])  # turns (i, i+1) of one episode
    config = PolicyLossConfig(off_policy_correction="none", loss_agg_mode="seq-mean-token-mean")
    summed, _ = _split_batch_losses(config, batch, inputs, [[i] for i in range(n)], rollout_ids=rollout_ids)
    per_token = [
        [ppo_token_loss(a, b, c, 0.2, 0.2, None)[0] for a, b, c in zip(lp, old, adv, strict=True)]
        for lp, old, adv in zip(
            *(_rows(batch, inputs[k]) for k in ("log_probs", "old_log_probs", "advantages")), strict=True
        )
    ]
    # reference: concatenate each rollout's samples into one sequence, then seq-mean-token-mean
    merged_loss, merged_mask = [], []
    for r in sorted(set(rollout_ids.tolist())):
        members = [i for i in range(n) if rollout_ids[i] == r]
        merged_loss.append([x for i in members for x in per_token[i]])
        merged_mask.append([m for i in members for m in batch.masks[i]])
    assert summed.item() == pytest.approx(aggregate(merged_loss, merged_mask, "seq-mean-token-mean"), abs=1e-12)


@pytest.mark.unit
def test_missing_old_log_probs_means_rollout_log_probs_are_the_proximal_policy() -> None:
    batch = random_batch(72)
    inputs = _inputs(batch, 73)
    decoupled = {**inputs, "old_log_probs": inputs["rollout_log_probs"]}
    one_step_off = {**inputs, "old_log_probs": None}
    expected, _ = compute_policy_loss(PolicyLossConfig(), **decoupled)
    loss, metrics = compute_policy_loss(PolicyLossConfig(), **one_step_off)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-14)
    assert metrics["train_rollout_logprob_abs_diff"] == 0.0


@pytest.mark.unit
def test_nan_log_prob_at_a_trained_token_is_a_clear_error() -> None:
    batch = random_batch(74)
    inputs = _inputs(batch, 75)
    broken = inputs["log_probs"].detach().clone()
    broken[0] = math.nan  # sample 0 is a length-1, fully trained sample
    with pytest.raises(ValueError, match=r"log_probs: non-finite value nan at index 0"):
        compute_policy_loss(PolicyLossConfig(), **{**inputs, "log_probs": broken})


@pytest.mark.unit
def test_garbage_at_masked_positions_does_not_reach_the_loss() -> None:
    batch = random_batch(76)
    inputs = _inputs(batch, 77)
    clean, _ = compute_policy_loss(PolicyLossConfig(), **inputs)
    masked = batch.loss_mask == 0
    dirty = {k: v.detach().clone() for k, v in inputs.items() if k not in ("loss_mask", "response_lengths")}
    for key in ("old_log_probs", "rollout_log_probs", "advantages"):
        dirty[key][masked] = math.inf
    dirty["log_probs"][masked] = math.nan
    dirty["log_probs"].requires_grad_()
    loss, _ = compute_policy_loss(
        PolicyLossConfig(), loss_mask=batch.loss_mask, response_lengths=batch.response_lengths, **dirty
    )
    loss.backward()
    assert loss.item() == pytest.approx(clean.item(), abs=1e-14)
    assert bool(torch.isfinite(dirty["log_probs"].grad).all())


@pytest.mark.unit
def test_all_masked_batch_gives_zero_loss_and_zero_gradient() -> None:
    log_probs = torch.randn(4, dtype=torch.float64, requires_grad=True)
    loss, metrics = compute_policy_loss(
        PolicyLossConfig(off_policy_correction="none"),
        log_probs=log_probs,
        old_log_probs=torch.zeros(4, dtype=torch.float64),
        rollout_log_probs=None,
        advantages=torch.ones(4, dtype=torch.float64),
        loss_mask=torch.zeros(4),
        response_lengths=torch.tensor([1, 3]),
    )
    loss.backward()
    assert loss.item() == 0.0 and metrics["num_tokens"] == 0.0
    assert bool((log_probs.grad == 0).all())


@pytest.mark.unit
def test_ratio_and_advantage_metrics_describe_trained_tokens() -> None:
    batch = random_batch(78)
    inputs = _inputs(batch, 79)
    _, metrics = compute_policy_loss(PolicyLossConfig(), **inputs)
    trained = batch.loss_mask > 0
    ratio = (inputs["log_probs"].detach() - inputs["old_log_probs"]).exp()[trained]
    assert metrics["ratio_max"] == pytest.approx(ratio.max().item())
    assert metrics["ratio_min"] == pytest.approx(ratio.min().item())
    assert metrics["ratio_mean"] == pytest.approx(ratio.mean().item())
    assert metrics["advantage_mean"] == pytest.approx(inputs["advantages"][trained].mean().item())
    assert metrics["ppo_kl"] == pytest.approx(
        (inputs["old_log_probs"] - inputs["log_probs"].detach())[trained].mean().item()
    )
    assert metrics["num_tokens"] == trained.sum().item()


@pytest.mark.unit
def test_entropy_coefficient_without_entropy_says_what_is_missing() -> None:
    batch = random_batch(80)
    with pytest.raises(ValueError, match=r"entropy_coef=0\.01 needs entropy"):
        compute_policy_loss(PolicyLossConfig(entropy_coef=0.01), **_inputs(batch, 81))
