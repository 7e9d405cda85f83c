"""The same formulas on CUDA: every helper must keep tensors on the input's device (skipped without CUDA)."""

import pytest
import torch
from policy_reference import packed_random, random_batch

from policies.advantages import compute_advantages
from policies.aggregation import global_denominator, rollout_token_denominators
from policies.config import PolicyLossConfig
from policies.losses import compute_policy_loss, effective_loss_mask
from policies.staleness import sample_staleness


@pytest.mark.gpu
@pytest.mark.parametrize("correction", ["none", "tis", "mis", "icepop"])
@pytest.mark.parametrize("estimator", ["grpo", "ppo", "reinforce_plus_plus"])
def test_cuda_results_match_cpu(correction: str, estimator: str) -> None:
    batch = random_batch(200, n_groups=6, max_len=200)  # long enough for several discounted-scan chunks
    config = PolicyLossConfig(
        advantage_estimator=estimator,
        off_policy_correction=correction,
        normalize_advantages=True,
        kl_coef=0.01,
        gamma=0.99,
        lambd=0.95,
        use_opsm=True,
    )
    old = packed_random(batch, 201, 0.5, -1.5)
    cpu = {
        "rewards": torch.randn(len(batch.lengths), dtype=torch.float64),
        "group_ids": batch.group_ids,
        "response_lengths": batch.response_lengths,
        "loss_mask": batch.loss_mask,
        "values": packed_random(batch, 202),
        "log_probs": old,
        "ref_log_probs": packed_random(batch, 203, 0.5, -1.5),
    }
    results = {}
    for device in ("cpu", "cuda"):
        inputs = {k: v.to(device) for k, v in cpu.items()}
        advantages, _ = compute_advantages(config, **inputs)
        log_probs = (inputs["log_probs"] + 0.1).requires_grad_()
        rollout = inputs["log_probs"] + packed_random(batch, 204, 0.3).to(device)
        mask = effective_loss_mask(
            config,
            loss_mask=inputs["loss_mask"],
            response_lengths=inputs["response_lengths"],
            old_log_probs=inputs["log_probs"],
            rollout_log_probs=rollout,
        )
        rollout_ids = torch.arange(len(batch.lengths), device=device) // 2
        loss, metrics = compute_policy_loss(
            config,
            log_probs=log_probs,
            old_log_probs=inputs["log_probs"],
            rollout_log_probs=rollout,
            advantages=advantages,
            loss_mask=inputs["loss_mask"],
            response_lengths=inputs["response_lengths"],
            denominator=global_denominator(
                config.loss_agg_mode, mask, inputs["response_lengths"], rollout_ids=rollout_ids
            ),
            sample_denominators=rollout_token_denominators(mask, inputs["response_lengths"], rollout_ids),
        )
        loss.backward()
        staleness = sample_staleness(
            3, torch.full_like(inputs["loss_mask"], 2, dtype=torch.long), inputs["response_lengths"]
        )
        results[device] = (advantages.cpu(), loss.item(), log_probs.grad.cpu(), metrics, staleness.cpu())
    torch.testing.assert_close(results["cuda"][0], results["cpu"][0], rtol=1e-9, atol=1e-9)
    assert results["cuda"][1] == pytest.approx(results["cpu"][1], abs=1e-9)
    torch.testing.assert_close(results["cuda"][2], results["cpu"][2], rtol=1e-9, atol=1e-9)
    assert results["cuda"][3] == pytest.approx(results["cpu"][3], abs=1e-9)
    assert torch.equal(results["cuda"][4], results["cpu"][4])


@pytest.mark.gpu
def test_bfloat16_log_probs_on_cuda_compute_in_float32() -> None:
    log_probs = torch.randn(8, device="cuda", dtype=torch.bfloat16).requires_grad_()
    loss, _ = compute_policy_loss(
        PolicyLossConfig(off_policy_correction="none"),
        log_probs=log_probs,
        old_log_probs=log_probs.detach(),
        rollout_log_probs=None,
        advantages=torch.ones(8, device="cuda"),
        loss_mask=torch.ones(8, device="cuda", dtype=torch.bool),
        response_lengths=torch.tensor([3, 5], device="cuda"),
    )
    assert loss.dtype == torch.float32
    loss.backward()
    assert log_probs.grad is not None and log_probs.grad.dtype == torch.bfloat16
