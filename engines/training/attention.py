"""`packed_sdpa`: variable-length attention for packed rows, without flash-attention.

transformers handles a packed row (position_ids restarting at 0) under `sdpa` by building a block-diagonal
[T, T] mask, so the kernel still computes every cross-sequence score and throws it away; on a 4k-token row of
heavy-tailed samples that is most of the attention work (measured 3x slower end to end on CPU). This
implementation cuts the row at the restarts and runs causal sdpa on the sequences alone, those of equal length
batched into one call: only Σ L_i² scores, no mask tensor at all. It is what flash-attention's varlen path does,
for machines without flash-attention.

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
    spans = sequence_spans(position_ids, length)
    dropout = dropout if module.training else 0.0
    if len(spans) == 1:
        output = _causal_attention(query, key, value, dropout=dropout, scaling=scaling, sliding_window=sliding_window)
        return output.transpose(1, 2).contiguous(), None
    output: Tensor | None = None
    for span_length, starts in _starts_by_length(spans).items():
        if len(starts) == 1:  # a length of its own: slice views, no gather
            positions: slice | Tensor = slice(starts[0], starts[0] + span_length)
            attended = _causal_attention(
                query[:, :, positions],
                key[:, :, positions],
                value[:, :, positions],
                dropout=dropout,
                scaling=scaling,
                sliding_window=sliding_window,
            )[0]
        else:  # n sequences of one length: gathered into [n, H, L, D], one kernel call, scattered back
            index = torch.tensor(starts, device=query.device)[:, None] + torch.arange(span_length, device=query.device)
            positions = index.reshape(-1)
            attended = _causal_attention(
                query[0][:, index].transpose(0, 1),
                key[0][:, index].transpose(0, 1),
                value[0][:, index].transpose(0, 1),
                dropout=dropout,
                scaling=scaling,
                sliding_window=sliding_window,
            )
            attended = attended.transpose(0, 1).reshape(attended.shape[1], -1, attended.shape[-1])
        if output is None:  # the kernel's dtype, which autocast may have changed from the inputs'
            output = attended.new_empty(attended.shape[0], length, attended.shape[-1])
        output[:, positions] = attended
    assert output is not None
    return output.unsqueeze(0).transpose(1, 2).contiguous(), None


def _starts_by_length(spans: list[tuple[int, int]]) -> dict[int, list[int]]:
    """Where the sequences of each length start.

    RL batches hold many short samples of few distinct lengths; one kernel call per sequence would spend its time
    in dispatch (256 calls per layer for a 256-sample CPU batch), one call per length does not.
    """
    starts: dict[int, list[int]] = {}
    for start, end in spans:
        starts.setdefault(end - start, []).append(start)
    return starts


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
