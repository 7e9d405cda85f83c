"""`SdpaAttention` computes what megatron's `DotProductAttention` computes, through torch's fused SDPA."""

from __future__ import annotations

import pytest
import torch

from engines.megatron import parallel
from engines.megatron.cpu_compat import maybe_cpu_compat

pytest.importorskip("megatron.core")


def _pair(query_groups: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from engines.megatron.attention import SdpaAttention

    config = TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=query_groups, attention_dropout=0.0
    )
    arguments = {"config": config, "layer_number": 1, "attn_mask_type": AttnMaskType.causal, "attention_type": "self"}
    return SdpaAttention(**arguments), DotProductAttention(**arguments)


@pytest.mark.unit
@pytest.mark.parametrize("query_groups", [4, 2])
def test_causal_attention_and_its_gradients_match_megatrons(megatron_world: None, query_groups: int) -> None:
    generator = torch.Generator().manual_seed(0)
    sequence, batch, heads, head_dim = 11, 3, 4, 16
    with maybe_cpu_compat():
        fused, reference = _pair(query_groups)
        device = parallel.compute_device()
        inputs = {
            "query": torch.randn(sequence, batch, heads, head_dim, generator=generator).to(device),
            "key": torch.randn(sequence, batch, query_groups, head_dim, generator=generator).to(device),
            "value": torch.randn(sequence, batch, query_groups, head_dim, generator=generator).to(device),
        }
        results = []
        for module in (fused, reference):
            leaves = {name: tensor.clone().requires_grad_() for name, tensor in inputs.items()}
            output = module(leaves["query"], leaves["key"], leaves["value"], None)
            output.square().sum().backward()
            results.append((output.detach(), {name: leaf.grad for name, leaf in leaves.items()}))
    (fused_out, fused_grads), (ref_out, ref_grads) = results
    assert fused_out.shape == (sequence, batch, heads * head_dim)
    torch.testing.assert_close(fused_out, ref_out, rtol=1e-5, atol=1e-6)
    for name in inputs:
        torch.testing.assert_close(fused_grads[name], ref_grads[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.unit
def test_an_explicit_mask_takes_megatrons_own_path(megatron_world: None) -> None:
    """The fused path is only the causal, unmasked case; anything else must stay megatron's arithmetic."""
    generator = torch.Generator().manual_seed(1)
    with maybe_cpu_compat():
        fused, reference = _pair(4)
        device = parallel.compute_device()
        query, key, value = (torch.randn(6, 2, 4, 16, generator=generator).to(device) for _ in range(3))
        mask = torch.rand(2, 1, 6, 6, generator=generator) > 0.7  # True = masked out, megatron's convention
        mask = (mask & ~torch.eye(6, dtype=torch.bool)).to(device)  # every query keeps at least itself
        assert not fused._fused_path_applies(query, key, mask, None, None)
        torch.testing.assert_close(fused(query, key, value, mask), reference(query, key, value, mask))
