"""`packed_sdpa`: per-sequence attention inside a packed row, checked against HF's own sdpa path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from engines.training import attention
from engines.training.attention import packed_sdpa_attention, register_packed_attention, sequence_spans
from engines.training.base import TrainSample
from engines.training.micro_batches import forward_packed, pack_inputs
from tools.standins.tiny_model import TinyModelSpec, build_tiny_model, build_tokenizer


@pytest.mark.unit
@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3", "qwen3_moe", "mixtral"])
def test_packed_row_logits_equal_each_sequence_run_alone_under_sdpa(family: str) -> None:
    register_packed_attention()
    model = build_tiny_model(TinyModelSpec(family=family), build_tokenizer()).eval()
    generator = torch.Generator().manual_seed(0)
    samples = [TrainSample(torch.randint(6, 100, (n,), generator=generator), n - 1) for n in (9, 2, 17, 5, 9, 2, 9)]
    model.config._attn_implementation = "sdpa"
    with torch.no_grad():
        alone = torch.cat([forward_packed(model, pack_inputs([sample])) for sample in samples])
        model.config._attn_implementation = "packed_sdpa"
        packed = forward_packed(model, pack_inputs(samples))
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)


@pytest.mark.unit
@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3_moe", "mixtral"])
def test_a_packed_forward_plans_its_row_once_for_every_layer(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The row's kernel calls (segments, index tensors, masks) depend only on its positions: made per layer they
    cost more than the kernels on a CPU batch of short samples. The plan must reach every layer's attention."""
    register_packed_attention()
    model = build_tiny_model(TinyModelSpec(family=family, num_hidden_layers=3), build_tokenizer()).eval()
    model.config._attn_implementation = "packed_sdpa"
    made: list[int] = []

    class CountedPlan(attention.RowPlan):
        def __init__(self, *args: object) -> None:
            made.append(1)
            super().__init__(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(attention, "RowPlan", CountedPlan)
    generator = torch.Generator().manual_seed(0)
    samples = [TrainSample(torch.randint(6, 100, (n,), generator=generator), 2) for n in (5, 7, 5)]
    with torch.no_grad():
        forward_packed(model, pack_inputs(samples))
    assert len(made) == 1


@pytest.mark.unit
def test_sequences_of_equal_length_batched_together_give_each_sequences_own_attention_and_gradients() -> None:
    """Equal-length sequences share one kernel call; outputs and q/k/v gradients must equal per-sequence calls."""
    generator = torch.Generator().manual_seed(1)
    lengths = [3, 5, 3, 1, 5, 3]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    total = int(positions.shape[1])
    query = torch.randn(1, 4, total, 8, generator=generator, requires_grad=True)
    key, value = (torch.randn(1, 2, total, 8, generator=generator, requires_grad=True) for _ in range(2))
    output, _ = packed_sdpa_attention(nn.Module().eval(), query, key, value, None, position_ids=positions)
    weights = torch.randn(output.shape, generator=generator)
    packed_grads = torch.autograd.grad((output * weights).sum(), (query, key, value))

    pieces = []
    for start, end in sequence_spans(positions, total):
        attended = F.scaled_dot_product_attention(
            query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], is_causal=True, enable_gqa=True
        )
        pieces.append(attended.transpose(1, 2))
    expected = torch.cat(pieces, dim=1)
    expected_grads = torch.autograd.grad((expected * weights).sum(), (query, key, value))
    torch.testing.assert_close(output, expected)
    for packed_grad, expected_grad in zip(packed_grads, expected_grads, strict=True):
        torch.testing.assert_close(packed_grad, expected_grad)


@pytest.mark.unit
def test_masked_calls_recomputed_in_the_backward_give_the_same_outputs_and_gradients(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A large masked call (a sliding window over a continuation and its context) is recomputed in the backward
    rather than keeping its mask: bit for bit the same outputs and q/k/v gradients as the call that keeps it."""
    generator = torch.Generator().manual_seed(2)
    positions = torch.cat([torch.arange(12), torch.arange(5, 12), torch.arange(9)])[None]  # a continuation at 5
    total = int(positions.shape[1])
    query = torch.randn(1, 4, total, 8, generator=generator, requires_grad=True)
    key, value = (torch.randn(1, 2, total, 8, generator=generator, requires_grad=True) for _ in range(2))
    weights = torch.randn(1, total, 4, 8, generator=generator)

    def attend() -> tuple[torch.Tensor, ...]:
        output, _ = packed_sdpa_attention(nn.Module().eval(), query, key, value, None, position_ids=positions,
                                          sliding_window=6)
        return (output, *torch.autograd.grad((output * weights).sum(), (query, key, value)))

    kept = attend()
    recomputed_calls = []
    monkeypatch.setattr(attention, "RECOMPUTED_MASK_ELEMENTS", 1)
    monkeypatch.setattr(attention, "checkpoint", lambda *a, **k: recomputed_calls.append(1) or checkpoint(*a, **k))
    recomputed = attend()
    assert recomputed_calls  # the windowed masked calls took the recomputed path
    for got, expected in zip(recomputed, kept, strict=True):
        assert torch.equal(got, expected)


@pytest.mark.unit
def test_spans_start_wherever_positions_restart() -> None:
    positions = torch.tensor([[0, 1, 2, 0, 0, 1, 0, 1, 2, 3]])
    assert sequence_spans(positions, 10) == [(0, 3), (3, 4), (4, 6), (6, 10)]
    assert sequence_spans(None, 4) == [(0, 4)]


@pytest.mark.unit
def test_sliding_window_limits_how_far_back_a_token_attends() -> None:
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, 2, 8, 4, generator=generator) for _ in range(3))
    rows = torch.arange(8)
    band = (rows[:, None] >= rows[None, :]) & (rows[:, None] - rows[None, :] < 3)
    expected = F.scaled_dot_product_attention(query, key, value, attn_mask=band).transpose(1, 2)
    output, _ = packed_sdpa_attention(nn.Module().eval(), query, key, value, None, sliding_window=3)
    torch.testing.assert_close(output, expected)


@pytest.mark.unit
def test_padded_batches_are_refused_rather_than_silently_unmasked() -> None:
    tensor = torch.zeros(2, 2, 4, 8)
    with pytest.raises(ValueError, match="one packed row; got a batch of 2 rows"):
        packed_sdpa_attention(nn.Module(), tensor, tensor, tensor, None)


def _backward_nodes(root: torch.Tensor) -> set[str]:
    seen, stack, names = set(), [root.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


@pytest.mark.unit
def test_shared_prompt_rows_are_gathered_by_index_select_whose_backward_adds_in_order() -> None:
    """A GRPO group's prompt rows are gathered once per response. Advanced indexing (`IndexBackward0`) would sum
    those repeats in its CPU backward with atomic adds from several threads, in the order they land: the same
    batch trained to other weights from run to run (measured: 3 of 4 replays on 2 threads). `index_select`'s
    backward adds them in index order."""
    positions = torch.tensor([[*range(6), *range(6, 9), *range(6, 9), *range(6, 10), *range(5), *range(5, 8)]])
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, heads, positions.shape[1], 8, generator=generator, requires_grad=True)
                         for heads in (4, 2, 2))
    output, _ = packed_sdpa_attention(nn.Module(), query, key, value, None, position_ids=positions)
    nodes = _backward_nodes(output.sum())
    assert "IndexSelectBackward0" in nodes  # the shared-prompt path ran
    assert "IndexBackward0" not in nodes


@pytest.mark.unit
def test_the_varlen_kernel_is_made_causal_by_the_keyword_this_torch_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    import inspect

    attention.varlen_kernel.cache_clear()
    kernel = attention.varlen_kernel()
    assert kernel is not None  # torch >= 2.9 ships it (CPU builds too, though its kernel needs CUDA)
    function, causal = kernel
    assert causal in ({"is_causal": True}, {"window_size": (-1, 0)})
    assert set(causal) <= set(inspect.signature(function).parameters)
    positions = torch.tensor([[0, 1, 2, 0, 1]])
    assert attention.RowPlan(positions, 5, positions.device).varlen is None  # CPU rows keep SDPA
    monkeypatch.setenv("SLIPSTREAM_NO_VARLEN", "1")
    attention.varlen_kernel.cache_clear()
    try:
        assert attention.varlen_kernel() is None
    finally:
        monkeypatch.delenv("SLIPSTREAM_NO_VARLEN")
        attention.varlen_kernel.cache_clear()
