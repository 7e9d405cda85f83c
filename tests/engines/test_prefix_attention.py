"""Attention after a prefix without a mask tensor: the same values and gradients as SDPA with the explicit
bottom-right causal mask it replaces."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engines.training import attention
from engines.training.attention import packed_sdpa_attention
from engines.training.prefix_attention import prefix_causal_attention


def masked_attention(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    queries, keys = query.shape[-2], key.shape[-2]
    positions = torch.arange(keys, device=query.device)
    mask = positions[keys - queries:, None] >= positions[None, :]
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                          enable_gqa=key.shape[-3] != query.shape[-3])


def values_and_gradients(attend, leaves: list[Tensor], weights: Tensor) -> tuple[Tensor, ...]:
    output = attend(*leaves)
    return (output, *torch.autograd.grad((output * weights).sum(), leaves))


@pytest.mark.unit
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float64, 1e-12), (torch.float32, 2e-6),
                                                  (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize(("batch", "heads", "kv_heads", "queries", "keys"),
                         [(1, 4, 4, 9, 9), (1, 6, 2, 37, 100), (3, 4, 1, 5, 12), (1, 4, 2, 1, 7)])
def test_equals_the_masked_kernel_forward_and_backward(dtype: torch.dtype, tolerance: float, batch: int,
                                                       heads: int, kv_heads: int, queries: int, keys: int) -> None:
    generator = torch.Generator().manual_seed(queries * keys)
    leaves = [torch.randn(batch, h, n, 16, generator=generator).to(dtype).requires_grad_()
              for h, n in ((heads, queries), (kv_heads, keys), (kv_heads, keys))]
    weights = torch.randn(batch, heads, queries, 16, generator=generator).to(dtype)
    got = values_and_gradients(lambda q, k, v: prefix_causal_attention(q, k, v, None), leaves, weights)
    expected = values_and_gradients(masked_attention, leaves, weights)
    for name, value, reference in zip(("output", "query grad", "key grad", "value grad"), got, expected, strict=True):
        assert value.shape == reference.shape and value.dtype == reference.dtype, name
        torch.testing.assert_close(value, reference, atol=tolerance, rtol=tolerance, msg=name)


@pytest.mark.unit
def test_runs_in_autocasts_precision_as_sdpa_does() -> None:
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, 4, n, 16, generator=generator) for n in (6, 20, 20))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = prefix_causal_attention(query, key, value, None)
        expected = masked_attention(query, key, value)
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, atol=3e-2, rtol=3e-2)


@pytest.mark.unit
def test_more_queries_than_keys_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="at least as many keys as queries; got 5 queries and 3 keys"):
        prefix_causal_attention(torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), None)


@pytest.mark.unit
def test_a_packed_row_of_continuations_builds_no_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """Long responses after a shared prompt and a context-parallel rank's late chunk attend through the prefix
    kernel: a [queries x keys] mask per call was what made a split 16k row peak above the whole row on one rank."""
    built = attention.RowPlan.mask

    def no_mask(*args: object) -> Tensor | None:
        mask = built(*args)  # type: ignore[arg-type]
        assert mask is None, "a mask was built for a call the prefix kernel covers"
        return mask

    monkeypatch.setattr(attention.RowPlan, "mask", no_mask)
    monkeypatch.setattr(attention, "PREFIX_KERNEL_ELEMENTS", 1)  # every continuation here is a short one
    positions = torch.cat([torch.arange(12), torch.arange(5, 12), torch.arange(5, 9), torch.arange(7)])[None]
    total = int(positions.shape[1])
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(1, 4, total, 8, generator=generator, requires_grad=True)
    key, value = (torch.randn(1, 2, total, 8, generator=generator, requires_grad=True) for _ in range(2))
    output, _ = packed_sdpa_attention(nn.Module().eval(), query, key, value, None, position_ids=positions)
    output.sum().backward()
    # the second continuation (positions 5..8) attends to the prompt's rows 0..4, then to itself
    expected = masked_attention(query[:, :, 19:23], torch.cat([key[:, :, :5], key[:, :, 19:23]], 2),
                       torch.cat([value[:, :, :5], value[:, :, 19:23]], 2))
    torch.testing.assert_close(output[:, 19:23].transpose(1, 2), expected)
