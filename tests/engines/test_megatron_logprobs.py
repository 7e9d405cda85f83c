"""The Megatron trainer's log-probs over a vocabulary split across TP ranks, in a one-rank world."""

from __future__ import annotations

import warnings

import pytest
import torch

from engines.training.logprobs import token_log_probs


@pytest.mark.integration
def test_one_rank_matches_the_torch_trainer_and_names_its_group_to_megatron(megatron_world: None) -> None:
    """megatron-core 0.16 warns "tp_group is None ... Passing tp_group will be mandatory soon" for a reduction
    that leaves its group to the default: the version that makes it mandatory would fail every train step."""
    from engines.megatron.logprobs import vocab_parallel_log_probs

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 40, generator=generator, requires_grad=True)  # 32 real columns, 8 of TP padding
    targets = torch.randint(0, 32, (6,), generator=generator)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = vocab_parallel_log_probs(logits, targets, temperature=0.7, with_entropy=True, vocab_size=32)
    assert [str(w.message) for w in caught if "tp_group" in str(w.message)] == []
    reference = token_log_probs(logits[:, :32], targets, temperature=0.7, with_entropy=True)
    torch.testing.assert_close(ours.log_probs, reference.log_probs)
    assert ours.entropy is not None and reference.entropy is not None
    torch.testing.assert_close(ours.entropy, reference.entropy)
