"""The Megatron trainer packs a micro-batch's samples into one row (THD), as slime does, instead of padding rows.

Packing is only right if nothing can tell it from padding: the same log-probs, entropy and gradients, each sample
attending to itself alone with its own rotary positions. These tests check the layout itself, the packed attention
against one call per sequence, and the whole trainer in both layouts.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from engines.megatron.batches import micro_batch_counts, plan_micro_batches, shard_for_rank
from engines.training import TrainSample
from tests.support.training import seeded_batch, step_loss

if TYPE_CHECKING:
    from megatron.core.packed_seq_params import PackedSeqParams

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")


def _samples(lengths: tuple[int, ...] = (9, 23, 14, 5, 17, 6)) -> list[TrainSample]:
    generator = torch.Generator().manual_seed(3)
    batch = []
    for length in lengths:
        response = length // 2
        tokens = torch.randint(6, 100, (length,), generator=generator)
        batch.append(TrainSample(tokens, response, advantages=torch.randn(response, generator=generator),
                                 loss_mask=torch.ones(response), reward=1.0))
    return batch


def _tokens(micro_batches: list) -> int:
    return sum(mb.input_ids.numel() for mb in micro_batches)


@pytest.mark.unit
def test_a_pack_holds_its_samples_end_to_end_each_with_its_own_positions_and_response_logits() -> None:
    samples = _samples()
    members = list(range(len(samples)))
    packs = plan_micro_batches(samples, members, 40, with_batch=True, qkv_format="thd")
    assert sorted(index for pack in packs for index in pack.members) == members
    for pack in packs:
        lengths = [int(samples[index].tokens.numel()) for index in pack.members]
        assert sum(lengths) <= 40 or len(lengths) == 1
        assert pack.input_ids.shape == pack.position_ids.shape == (1, sum(lengths))
        edges = pack.packed_seq_params.cu_seqlens_q.tolist()
        assert edges == [sum(lengths[:i]) for i in range(len(lengths) + 1)]
        assert pack.packed_seq_params.cu_seqlens_q.dtype == torch.int32
        assert pack.packed_seq_params.max_seqlen_q == max(lengths)
        for start, index in zip(edges, pack.members, strict=False):
            sample = samples[index]
            end = start + int(sample.tokens.numel())
            assert torch.equal(pack.input_ids[0, start:end], sample.tokens)
            assert torch.equal(pack.position_ids[0, start:end], torch.arange(end - start))
        # The logit at each selected column predicts the token right after it: the response, in sample order.
        assert (pack.logit_rows == 0).all()
        assert torch.equal(pack.input_ids[0, pack.logit_columns + 1], pack.targets)
        assert pack.response_lengths == tuple(samples[index].response_length for index in pack.members)
        assert pack.batch is not None and pack.batch.advantages.numel() == sum(pack.response_lengths)
    padded = plan_micro_batches(samples, members, 40, with_batch=False, qkv_format="bshd")
    assert _tokens(packs) == sum(int(s.tokens.numel()) for s in samples) < _tokens(padded)
    assert len(packs) <= len(padded)


@pytest.mark.unit
def test_padding_a_pack_to_the_tensor_parallel_size_adds_a_tail_sequence_and_changes_no_selection() -> None:
    samples = _samples()
    members = list(range(len(samples)))
    plain = plan_micro_batches(samples, members, 40, with_batch=False, qkv_format="thd")
    padded = plan_micro_batches(samples, members, 40, with_batch=False, pad_multiple=4, qkv_format="thd")
    assert [mb.members for mb in padded] == [mb.members for mb in plain]
    for before, after in zip(plain, padded, strict=True):
        width, total = before.input_ids.shape[1], after.input_ids.shape[1]
        assert total % 4 == 0 and width <= total < width + 4
        edges = after.packed_seq_params.cu_seqlens_q.tolist()
        assert edges == before.packed_seq_params.cu_seqlens_q.tolist() + ([total] if total > width else [])
        assert (after.input_ids[0, width:] == 0).all()
        assert torch.equal(after.position_ids[0, width:], torch.arange(total - width))
        for name in ("logit_rows", "logit_columns", "targets"):
            assert torch.equal(getattr(after, name), getattr(before, name)), name


@pytest.mark.unit
@pytest.mark.parametrize("qkv_format", ["thd", "bshd"])
def test_every_rank_counts_every_ranks_micro_batches_as_it_plans_them(qkv_format: str) -> None:
    """Expert parallelism tops each rank up to the busiest rank's count, and the router losses divide by the
    step's; both come from this count, made without asking the other ranks."""
    generator = torch.Generator().manual_seed(3)
    samples = [TrainSample(tokens=torch.arange(int(n)), response_length=2)
               for n in torch.randint(3, 40, (23,), generator=generator)]
    lengths = [int(sample.tokens.numel()) for sample in samples]
    for ranks in (1, 2, 3):
        planned = [len(plan_micro_batches(samples, shard_for_rank(lengths, ranks, rank), 50, qkv_format=qkv_format,
                                          with_batch=False, pad_multiple=2)) for rank in range(ranks)]
        assert micro_batch_counts(lengths, ranks, 50, qkv_format=qkv_format, pad_multiple=2) == planned


@pytest.mark.unit
def test_an_unknown_layout_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"qkv_format must be one of \('thd', 'bshd'\), got 'sbhd'"):
        plan_micro_batches(_samples(), [0], 40, qkv_format="sbhd", with_batch=False)


def _attention(query_groups: int) -> torch.nn.Module:
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from engines.megatron.attention import SdpaAttention

    config = TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=query_groups, attention_dropout=0.0
    )
    return SdpaAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")


def _packed_params(lengths: list[int]) -> PackedSeqParams:
    from megatron.core.packed_seq_params import PackedSeqParams

    edges = torch.tensor([sum(lengths[:i]) for i in range(len(lengths) + 1)], dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=edges, cu_seqlens_kv=edges,
                           max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))


@pytest.mark.unit
@pytest.mark.parametrize("query_groups", [4, 2])
def test_packed_attention_equals_one_causal_call_per_sequence(megatron_world: None, query_groups: int) -> None:
    """Each sequence of a pack sees itself alone: the same outputs and gradients as attending to it on its own."""
    from engines.megatron import parallel
    from engines.megatron.cpu_compat import maybe_cpu_compat
    from engines.megatron.pack_groups import build_plan

    generator = torch.Generator().manual_seed(0)
    lengths, heads, head_dim = [5, 11, 1, 10, 7, 9, 10, 4, 6, 5], 4, 16
    plan = build_plan([sum(lengths[:i]) for i in range(len(lengths) + 1)], torch.device("cpu"))
    assert len(plan.groups) < len(lengths)  # some sequences share a padded SDPA call ...
    assert any(not group.valid.all() for group in plan.groups)  # ... with padding inside it
    with maybe_cpu_compat():
        attention = _attention(query_groups)
        device = parallel.compute_device()
        total = sum(lengths)
        inputs = {
            "query": torch.randn(total, heads, head_dim, generator=generator).to(device),
            "key": torch.randn(total, query_groups, head_dim, generator=generator).to(device),
            "value": torch.randn(total, query_groups, head_dim, generator=generator).to(device),
        }
        packed_leaves = {name: tensor.clone().requires_grad_() for name, tensor in inputs.items()}
        packed = attention(packed_leaves["query"], packed_leaves["key"], packed_leaves["value"], None,
                           packed_seq_params=_packed_params(lengths))
        packed.square().sum().backward()
        alone_leaves = {name: tensor.clone().requires_grad_() for name, tensor in inputs.items()}
        pieces, start = [], 0
        for length in lengths:
            # [l, n, hn] -> [l, b=1, n, hn]: the padded layout's one-row batch
            one = (alone_leaves[name][start : start + length].unsqueeze(1) for name in ("query", "key", "value"))
            pieces.append(attention(*one, None).squeeze(1))
            start += length
        alone = torch.cat(pieces)
        alone.square().sum().backward()
    assert packed.shape == (total, heads * head_dim)
    torch.testing.assert_close(packed, alone)
    for name in inputs:
        torch.testing.assert_close(packed_leaves[name].grad, alone_leaves[name].grad, msg=name)


@pytest.mark.unit
def test_boundaries_that_do_not_cover_the_pack_are_a_clear_error(megatron_world: None) -> None:
    from engines.megatron.cpu_compat import maybe_cpu_compat

    with maybe_cpu_compat():
        attention = _attention(4)
        query = key = value = torch.zeros(10, 4, 16)
        with pytest.raises(ValueError, match=r"cu_seqlens \[0, 4, 8\] do not partition the pack's 10 tokens"):
            attention(query, key, value, None, packed_seq_params=_packed_params([4, 4]))


@pytest.mark.unit
def test_length_groups_cover_every_sequence_once_within_the_attention_slack() -> None:
    from engines.megatron.pack_groups import SLACK, group_spans

    generator = torch.Generator().manual_seed(5)
    lengths = [int(x) for x in torch.randint(1, 200, (300,), generator=generator)] + [7] * 40
    edges = [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    spans = list(itertools.pairwise(edges))
    groups = group_spans(spans)
    assert sorted(span for group in groups for span in group) == sorted(spans)
    for group in groups:
        widths = [end - start for start, end in group]
        assert widths[0] == max(widths)  # the first is the longest: the padded width
        assert len(widths) * widths[0] ** 2 <= SLACK * sum(w**2 for w in widths)
    assert len(groups) < len(spans) / 4  # a few SDPA calls, not one per sequence


def _run(model_path: Path, qkv_format: str) -> dict:
    from engines.megatron import MegatronTrainer, MegatronTrainerConfig

    # eps=1 keeps AdamW's first update proportional to the gradient (the parity tests' reasoning): a gradient
    # that is zero up to rounding, like the key bias's, must not be blown up into a full-size step.
    config = MegatronTrainerConfig(model_path=model_path, micro_batch_tokens=60, qkv_format=qkv_format, lr=1e-2,
                                   eps=1.0)
    trainer = MegatronTrainer(config)
    try:
        batch = seeded_batch()
        outputs = trainer.compute_log_probs(batch, temperature=0.9, with_entropy=True)
        step = trainer.train_step(batch, step_loss(batch), temperature=0.9, with_entropy=True)
        weights = {name: tensor.clone() for name, tensor in trainer.named_tensors()}
        return {"outputs": outputs, "step": step, "weights": weights}
    finally:
        trainer.close()


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_the_trainer_takes_the_same_step_from_packed_and_from_padded_rows(tiny_model_path: Path) -> None:
    packed, padded = _run(tiny_model_path, "thd"), _run(tiny_model_path, "bshd")
    torch.testing.assert_close(packed["outputs"].log_probs, padded["outputs"].log_probs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed["outputs"].entropy, padded["outputs"].entropy, rtol=1e-5, atol=1e-5)
    assert packed["step"].grad_norm == pytest.approx(padded["step"].grad_norm, rel=1e-4)
    assert packed["step"].metrics["loss"] == pytest.approx(padded["step"].metrics["loss"], rel=1e-5, abs=1e-7)
    assert packed["step"].metrics["micro_batches"] <= padded["step"].metrics["micro_batches"]
    for name, tensor in packed["weights"].items():
        torch.testing.assert_close(tensor, padded["weights"][name], rtol=1e-4, atol=1e-6, msg=name)
