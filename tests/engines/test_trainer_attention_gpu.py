"""packed_sdpa on a GPU: a row of plain sequences goes to torch's flash varlen kernel, same values as SDPA; a call
after a prefix goes to torch's lower-right causal bias, same values as the explicit mask."""

from __future__ import annotations

import pytest
import torch

from engines.training import attention
from engines.training.prefix_attention import prefix_causal_attention
from tests.engines.test_prefix_attention import masked_attention, values_and_gradients


@pytest.mark.gpu
@pytest.mark.parametrize("kv_heads", [2, 8])
def test_varlen_row_equals_the_sdpa_path_forward_and_backward(kv_heads: int) -> None:
    assert attention.varlen_kernel() is not None, "this torch has no flash varlen attention"
    lengths = [3, 57, 200, 9, 128, 1, 64]
    positions = torch.cat([torch.arange(length) for length in lengths]).unsqueeze(0).cuda()
    total, heads, dim = sum(lengths), 8, 64
    generator = torch.Generator(device="cuda").manual_seed(0)
    states = [torch.randn(1, h, total, dim, device="cuda", dtype=torch.bfloat16, generator=generator)
              for h in (heads, kv_heads, kv_heads)]
    module = torch.nn.Module().eval()
    results = {}
    for path in ("varlen", "sdpa"):
        plan = attention.RowPlan(positions, total, positions.device)
        assert plan.varlen is not None
        if path == "sdpa":
            plan.varlen = None
        leaves = [state.clone().requires_grad_() for state in states]
        output, _ = attention.packed_sdpa_attention(module, *leaves, None, packed_plan=plan)
        output.float().square().sum().backward()
        results[path] = (output.detach().float(), [leaf.grad.float() for leaf in leaves])
    torch.testing.assert_close(results["varlen"][0], results["sdpa"][0], atol=2e-2, rtol=2e-2)
    for varlen_grad, sdpa_grad in zip(results["varlen"][1], results["sdpa"][1], strict=True):
        torch.testing.assert_close(varlen_grad, sdpa_grad, atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
def test_shared_prompt_rows_and_float32_rows_keep_the_sdpa_path() -> None:
    continued = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 8, 9, 10]]).cuda()  # a response after a prompt
    assert attention.RowPlan(continued, 15, continued.device).varlen is None
    plain = torch.tensor([[0, 1, 2, 0, 1]]).cuda()
    plan = attention.RowPlan(plain, 5, plain.device)
    assert plan.varlen is not None
    query = torch.randn(1, 4, 5, 16, device="cuda")  # float32: flash has no kernel for it
    output, _ = attention.packed_sdpa_attention(torch.nn.Module().eval(), query, query, query, None, packed_plan=plan)
    assert output.shape == (1, 5, 4, 16) and output.dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_a_gpu_the_lower_right_bias_equals_the_masked_kernel(dtype: torch.dtype) -> None:
    generator = torch.Generator(device="cuda").manual_seed(0)
    leaves = [torch.randn(1, 8, n, 64, device="cuda", generator=generator).to(dtype).requires_grad_()
              for n in (300, 1000, 1000)]
    weights = torch.randn(1, 8, 300, 64, device="cuda", generator=generator).to(dtype)
    got = values_and_gradients(lambda q, k, v: prefix_causal_attention(q, k, v, None), leaves, weights)
    expected = values_and_gradients(masked_attention, leaves, weights)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for value, reference in zip(got, expected, strict=True):
        torch.testing.assert_close(value, reference, atol=tolerance, rtol=tolerance)
