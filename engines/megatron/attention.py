"""Causal self-attention through torch's fused `scaled_dot_product_attention`, for megatron's local layer spec.

megatron-core 0.16.1's local spec (`get_gpt_layer_local_spec`) offers one core attention, `DotProductAttention`:
a `baddbmm` into a [b * heads, s, s] score matrix, a softmax (fused only with megatron's or apex's CUDA
kernels), and a `bmm`. Its only other choice is the "kitchen" SDPA backend, which needs NVIDIA's kitchen
package. So the full score matrix is materialised per layer, O(s^2) memory, and no flash kernel ever runs.

`SdpaAttention` keeps `DotProductAttention`'s construction, parameters and checkpoint layout (it subclasses it)
and replaces the causal, unmasked, dropout-free forward, the only one our trainer runs, with
`torch.nn.functional.scaled_dot_product_attention`, which dispatches to flash / memory-efficient kernels on CUDA
(bf16) and to a fused CPU kernel otherwise. Any other case (an explicit mask, a bias, dropout while training,
windows, softmax offsets, query-key layer scaling, cross-length attention) falls back to megatron's
implementation, so the result never silently differs.

It also runs packed sequences (THD, see `engines.megatron.batches`), which megatron's local attention refuses:
megatron hands the core attention [t, heads, hn] tensors of several sequences laid end to end, with their
boundaries in `PackedSeqParams.cu_seqlens_q`, after applying each sequence's own rotary positions. Each sequence
then attends causally to itself alone: sequences of similar length run as one right-padded SDPA batch
(`engines.megatron.pack_groups`), so no [t, t] mask is ever built and a pack of hundreds of short answers takes
a few SDPA calls, not hundreds. (Transformer Engine's attention does the same in one varlen kernel.)

Where transformer-engine is installed the trainer uses TE's layer spec instead (`engines.megatron.bridge`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from torch import Tensor

from engines.megatron.pack_groups import plan_for


class SdpaAttention(DotProductAttention):
    """`DotProductAttention` whose causal forward runs torch's fused SDPA (see the module docstring)."""

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> Tensor:
        """[sq, b, heads, hn] query and [sk, b, groups, hn] key/value -> [sq, b, heads * hn] context; packed
        (THD): [t, heads, hn] and [t, groups, hn] -> [t, heads * hn]."""
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if not self._fused_path_applies(query, key, attention_mask, attn_mask_type, attention_bias):
            return super().forward(
                query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
            )
        if packed:
            return self._packed_forward(query, key, value, packed_seq_params)
        if packed_seq_params is not None:
            raise ValueError(
                f"SdpaAttention: packed sequences in {packed_seq_params.qkv_format!r} format are not "
                "supported, only 'thd'"
            )
        # [s, b, n, hn] -> [b, n, s, hn]: the layout SDPA expects; the head dim stays contiguous.
        query, key, value = (tensor.permute(1, 2, 0, 3) for tensor in (query, key, value))
        # [b, n, s, hn] -> [s, b, n * hn]
        context = self._causal(query, key, value).permute(2, 0, 1, 3).contiguous()
        return context.view(*context.shape[:2], self.hidden_size_per_partition)

    def _packed_forward(self, query: Tensor, key: Tensor, value: Tensor, packed_seq_params: Any) -> Tensor:
        """Each sequence of the pack attends causally to itself alone (see the module docstring)."""
        bounds = packed_seq_params.cu_seqlens_q_padded
        if bounds is None:
            bounds = packed_seq_params.cu_seqlens_q
        kv_bounds = packed_seq_params.cu_seqlens_kv_padded
        if kv_bounds is None:
            kv_bounds = packed_seq_params.cu_seqlens_kv
        if kv_bounds is not None and kv_bounds is not bounds and not torch.equal(kv_bounds, bounds):
            raise ValueError("SdpaAttention: packed self-attention needs cu_seqlens_kv equal to cu_seqlens_q")
        plan = plan_for(bounds, query.shape[0], query.device)
        contexts = []
        for group in plan.groups:
            # [t, n, hn] -> [sequences, longest, n, hn] -> [sequences, n, longest, hn]
            rows = (tensor[group.gather].transpose(1, 2) for tensor in (query, key, value))
            # back to [sequences, longest, n, hn], then the real slots only: [tokens of the group, n, hn]
            contexts.append(self._causal(*rows).transpose(1, 2)[group.valid])
        context = torch.cat(contexts)[plan.order]
        # [t, n, hn] -> [t, n * hn]
        return context.reshape(query.shape[0], self.hidden_size_per_partition)

    def _causal(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """[b, heads, s, hn] query, [b, groups, s, hn] key/value -> [b, heads, s, hn]."""
        heads, groups = self.num_attention_heads_per_partition, self.num_query_groups_per_partition
        if heads // groups > 1:
            key = key.repeat_interleave(heads // groups, dim=1)
            value = value.repeat_interleave(heads // groups, dim=1)
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=self.softmax_scale)

    def _fused_path_applies(
        self,
        query: Tensor,
        key: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None,
        attention_bias: Tensor | None,
    ) -> bool:
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        dropout = self.attention_dropout.p if self.training else 0.0
        return (
            mask_type == AttnMaskType.causal
            and attention_mask is None
            and attention_bias is None
            and dropout == 0.0
            and query.shape[0] == key.shape[0]
            and self.softmax_offset is None
            and not self.config.apply_query_key_layer_scaling
            and self.scale_mask_softmax.window_size is None
        )
