"""`packed_sdpa`: variable-length attention for packed rows, without flash-attention.

transformers handles a packed row (position_ids restarting at 0) under `sdpa` by building a block-diagonal
[T, T] mask, so the kernel still computes every cross-sequence score and throws it away; on a 4k-token row of
heavy-tailed samples that is most of the attention work (measured 3x slower end to end on CPU). This
implementation cuts the row at the restarts and runs causal sdpa on each sequence alone: only Σ L_i² scores,
no mask tensor at all. It is what flash-attention's varlen path does, for machines without flash-attention.

Scope: one packed row (batch size 1), as the trainer produces. transformers builds no mask for a custom
attention name, so a padded batch would silently lose its padding mask; that case is refused loudly instead.
Sliding windows are honoured; attention sinks and logit soft-capping are not supported (use "sdpa").
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface

NAME = "packed_sdpa"


def packed_sdpa_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    position_ids: Tensor | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Signature of a transformers attention function: q [1, H, T, D], k/v [1, H_kv, T, D] -> [1, T, H, D]."""
    if query.shape[0] != 1:
        raise ValueError(f"{NAME} attends within one packed row; got a batch of {query.shape[0]} rows (use 'sdpa')")
    if softcap is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError(f"{NAME} does not support logit soft-capping or attention sinks; use 'sdpa'")
    length = query.shape[2]
    outputs = []
    for start, end in sequence_spans(position_ids, length):
        outputs.append(
            _causal_attention(
                query[:, :, start:end],
                key[:, :, start:end],
                value[:, :, start:end],
                dropout=dropout if module.training else 0.0,
                scaling=scaling,
                sliding_window=sliding_window,
            )
        )
    output = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
    return output.transpose(1, 2).contiguous(), None


def sequence_spans(position_ids: Tensor | None, length: int) -> list[tuple[int, int]]:
    """[start, end) of each packed sequence: a new one begins wherever positions do not continue by +1."""
    if position_ids is None:
        return [(0, length)]
    positions = position_ids.reshape(-1)[:length]
    breaks = (positions[1:] != positions[:-1] + 1).nonzero().flatten().add(1).tolist()
    edges = [0, *breaks, length]
    return list(itertools.pairwise(edges))


def _causal_attention(
    query: Tensor, key: Tensor, value: Tensor, *, dropout: float, scaling: float | None, sliding_window: int | None
) -> Tensor:
    length = query.shape[2]
    mask = None
    if sliding_window is not None and length > sliding_window:
        rows = torch.arange(length, device=query.device)
        distance = rows[:, None] - rows[None, :]
        mask = (distance >= 0) & (distance < sliding_window)
    return F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=mask,
        dropout_p=dropout,
        is_causal=mask is None,
        scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1],
    )


def register_packed_attention() -> None:
    """Make `attn_implementation="packed_sdpa"` known to transformers (idempotent; process-wide registry)."""
    AttentionInterface.register(NAME, packed_sdpa_attention)
