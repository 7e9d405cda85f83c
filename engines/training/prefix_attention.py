"""Causal attention of queries that are the last L of S key positions, without a [L x S] mask.

A response attending to its shared prompt, and a context-parallel rank's late chunk attending to the row before
it, are such calls. torch's SDPA takes them only through an explicit bottom-right mask: on a CPU its flash kernel
then copies the mask to float and reads it with every score (one [4k x 16k] call, forward and backward: 382 MiB
and 4.3 s masked, 91 MiB and 3.3 s here; docs/long-context.md).

The call is cut where the mask's shape changes: the L queries attend to the S - L prefix keys without a mask and
to their own L keys with the causal flag (square, so top-left and bottom-right agree); the two partial results
are joined by their log-sum-exps. The backward runs the kernel's own backward on each part with the joined output
and log-sum-exp, which is the exact gradient of the whole softmax (the way ring attention splits its blocks), so
nothing of size L x S is ever held. On CUDA torch's `causal_lower_right` bias reaches fused kernels directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

_flash_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def prefix_causal_attention(query: Tensor, key: Tensor, value: Tensor, scale: float | None) -> Tensor:
    """q [..., H, L, D], k/v [..., H_kv, S, D] with S >= L -> [..., H, L, D]: query i sits at key position
    S - L + i and sees the keys up to it. Fewer KV heads than query heads are read in groups (GQA)."""
    if query.shape[-2] > key.shape[-2]:
        raise ValueError(f"prefix attention needs at least as many keys as queries; got {query.shape[-2]} "
                         f"queries and {key.shape[-2]} keys")
    if query.device.type != "cpu":
        return F.scaled_dot_product_attention(query, key, value, causal_lower_right(query.shape[-2], key.shape[-2]),
                                              scale=scale, enable_gqa=key.shape[-3] != query.shape[-3])
    if torch.is_autocast_enabled("cpu"):  # as SDPA would run under autocast: in its lower precision
        dtype = torch.get_autocast_dtype("cpu")
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    with torch.autocast("cpu", enabled=False):
        return _PrefixCausal.apply(query, key, value, scale)


class _PrefixCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, query: Tensor, key: Tensor, value: Tensor,
                scale: float | None) -> Tensor:
        prefix = key.shape[-2] - query.shape[-2]
        output, log_sum_exp = _flash_forward(query, key[..., prefix:, :], value[..., prefix:, :], 0.0, True,
                                             scale=scale)
        if prefix:
            before, before_log_sum_exp = _flash_forward(query, key[..., :prefix, :], value[..., :prefix, :], 0.0,
                                                        False, scale=scale)
            joined = torch.logaddexp(before_log_sum_exp, log_sum_exp)
            output = (before * (before_log_sum_exp - joined).exp().unsqueeze(-1).to(before.dtype)
                      + output * (log_sum_exp - joined).exp().unsqueeze(-1).to(output.dtype))
            log_sum_exp = joined
        ctx.save_for_backward(query, key, value, output, log_sum_exp)
        ctx.scale = scale  # type: ignore[attr-defined]
        return output

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_output: Tensor,  # type: ignore[override]
                 ) -> tuple[Tensor, Tensor, Tensor, None]:
        query, key, value, output, log_sum_exp = ctx.saved_tensors  # type: ignore[attr-defined]
        scale = ctx.scale  # type: ignore[attr-defined]
        prefix = key.shape[-2] - query.shape[-2]
        grad_output = grad_output.contiguous()
        grad_query, grad_key, grad_value = _flash_backward(
            grad_output, query, key[..., prefix:, :], value[..., prefix:, :], output, log_sum_exp, 0.0, True,
            scale=scale)
        if prefix:
            query_part, key_part, value_part = _flash_backward(
                grad_output, query, key[..., :prefix, :], value[..., :prefix, :], output, log_sum_exp, 0.0, False,
                scale=scale)
            grad_query = grad_query + query_part
            grad_key = torch.cat([key_part, grad_key], dim=-2)
            grad_value = torch.cat([value_part, grad_value], dim=-2)
        return grad_query, grad_key, grad_value, None
