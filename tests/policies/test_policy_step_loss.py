"""The learner step's loss object: whole-step denominators, and the one rule for where pi_old comes from."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from policies.config import PolicyLossConfig
from policies.step_loss import PolicyLoss, pi_old_source, step_denominators


@dataclass
class Batch:
    response_lengths: Tensor
    loss_mask: Tensor | None
    rollout_log_probs: Tensor | None = None
    old_log_probs: Tensor | None = None
    ref_log_probs: Tensor | None = None
    advantages: Tensor | None = None


@dataclass
class Outputs:
    log_probs: Tensor
    entropy: Tensor | None = None


@pytest.mark.unit
@pytest.mark.parametrize(
    ("flags", "decoupled", "expected"),
    [
        ({"off_policy_correction": "none"}, False, "rollout"),
        ({"loss_type": "sft", "off_policy_correction": "tis"}, True, "rollout"),
        ({"off_policy_correction": "tis"}, False, "training_forward"),
        ({"off_policy_correction": "icepop"}, False, "training_forward"),
        ({"off_policy_correction": "none"}, True, "training_forward"),
        ({"off_policy_correction": "mis"}, False, "separate_forward"),  # rejections change the denominators
        ({"off_policy_correction": "tis", "kl_coef": 0.1}, False, "separate_forward"),  # advantages read pi_old
    ],
)
def test_pi_old_comes_from_the_training_forward_unless_something_needs_it_first(
    flags: dict, decoupled: bool, expected: str
) -> None:
    assert pi_old_source(PolicyLossConfig(**flags), decoupled=decoupled) == expected


@pytest.mark.unit
def test_needs_ref_holds_for_kl_as_loss_or_as_reward_penalty() -> None:
    assert not PolicyLossConfig().needs_ref
    assert PolicyLossConfig(use_kl_loss=True, kl_loss_coef=0.1).needs_ref
    assert PolicyLossConfig(kl_coef=0.1).needs_ref


@pytest.mark.unit
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batch_losses_sum_to_the_full_batch_loss_with_mis_rejections(mode: str) -> None:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor([3, 5, 2, 4])
    tokens = int(lengths.sum())
    fields = {
        "loss_mask": (torch.rand(tokens, generator=generator) > 0.2).float(),
        "rollout_log_probs": -torch.rand(tokens, generator=generator),
        "old_log_probs": -torch.rand(tokens, generator=generator),
        "advantages": torch.randn(tokens, generator=generator),
    }
    log_probs = -torch.rand(tokens, generator=generator)
    config = PolicyLossConfig(off_policy_correction="mis", mis_upper_bound=1.5, loss_agg_mode=mode)
    counts = step_denominators(config, loss_mask=fields["loss_mask"], response_lengths=lengths,
                               old_log_probs=fields["old_log_probs"], rollout_log_probs=fields["rollout_log_probs"])
    loss = PolicyLoss(config, denominator=float(counts[0]), total_tokens=float(counts[1]))
    full, full_metrics = loss(Outputs(log_probs), Batch(lengths, **fields))
    assert full_metrics["num_rejected_tokens"] > 0  # the rejections took part
    parts = []
    for samples in ([0, 1], [2, 3]):
        start, end = int(lengths[: samples[0]].sum()), int(lengths[: samples[-1] + 1].sum())
        part = {name: value[start:end] for name, value in fields.items()}
        parts.append(loss(Outputs(log_probs[start:end]), Batch(lengths[samples], **part))[0])
    torch.testing.assert_close(parts[0] + parts[1], full, atol=1e-6, rtol=1e-6)
