"""`packed_sdpa`: variable-length attention for packed rows, without flash-attention.

transformers handles a packed row (position_ids restarting at 0) under `sdpa` by building a block-diagonal
[T, T] mask, so the kernel still computes every cross-sequence score and throws it away; on a 4k-token row of
heavy-tailed samples that is most of the attention work (measured 3x slower end to end on CPU). This
implementation cuts the row at the restarts and runs causal sdpa on the sequences alone, those of equal length
batched into one call: only Σ L_i² scores, no mask tensor at all. It is what flash-attention's varlen path does,
for machines without flash-attention.

It also reads rows whose samples share their prompt (`pack_inputs(share_prompts=True)`): a segment whose
positions start at p > 0 continues the sequence before it after that sequence's first p tokens, so the prompt of
a GRPO group is computed once and every response attends to it. Its keys are the prompt's and its own, gathered
per (p, length) shape into one call, with a causal mask aligned to the end. Flash-attention's varlen path and HF's
masks would read such a segment as a sequence of its own, which is why only this attention gets shared rows.

Scope: one packed row (batch size 1), as the trainer produces. transformers builds no mask for a custom
attention name, so a padded batch would silently lose its padding mask; that case is refused loudly instead.
Sliding windows are honoured; attention sinks and logit soft-capping are not supported (use "sdpa").
"""

from __future__ import annotations

from dataclasses import dataclass
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
    segments = packed_segments(position_ids, length)
    dropout = dropout if module.training else 0.0
    if len(segments) == 1:
        output = _causal_attention(query, key, value, dropout=dropout, scaling=scaling, sliding_window=sliding_window)
        return output.transpose(1, 2).contiguous(), None
    output: Tensor | None = None
    for (prefix, span_length), members in _segments_by_shape(segments).items():
        attended, positions = _attend_alike(query, key, value, prefix, span_length, members, dropout=dropout,
                                            scaling=scaling, sliding_window=sliding_window)
        if output is None:  # the kernel's dtype, which autocast may have changed from the inputs'
            output = attended.new_empty(attended.shape[0], length, attended.shape[-1])
        output[:, positions] = attended
    assert output is not None
    return output.unsqueeze(0).transpose(1, 2).contiguous(), None


@dataclass(frozen=True)
class Segment:
    """One run of the row whose positions count up by one: a sequence, or a continuation of a shared prompt.

    A segment whose first position is 0 starts a sequence. One that starts at position p > 0 continues the
    latest sequence after its first p tokens (a sample whose prompt was packed once for its whole group): it
    attends to those p tokens, then causally to itself.
    """

    start: int
    end: int
    prefix: int  # the first position: tokens of the root it attends to before its own
    root: int  # where the sequence it continues starts in the row (itself when prefix is 0)


def packed_segments(position_ids: Tensor | None, length: int) -> list[Segment]:
    """The row's segments, each with the root sequence it continues (see `Segment`)."""
    if position_ids is None:
        return [Segment(0, length, 0, 0)]
    positions = position_ids.reshape(-1)[:length]
    starts = torch.cat([positions.new_zeros(1), (positions[1:] != positions[:-1] + 1).nonzero().flatten().add(1)])
    # One transfer of the starts and their first positions: the only host sync of a layer's call.
    start_list, firsts = torch.stack([starts, positions[starts]]).tolist()
    if len(start_list) == 1:  # one sequence, wherever its positions begin
        return [Segment(0, length, 0, 0)]
    segments, root = [], None
    for start, end, first in zip(start_list, [*start_list[1:], length], firsts, strict=True):
        if first == 0:
            root = (start, end)
        elif root is None or first > root[1] - root[0]:
            raise ValueError(f"{NAME}: packed positions restart at {first} (row position {start}) without a "
                             f"sequence of at least {first} tokens before it to continue")
        segments.append(Segment(start, end, first, start if first == 0 else root[0]))
    return segments


def _segments_by_shape(segments: list[Segment]) -> dict[tuple[int, int], list[Segment]]:
    """Segments grouped by (prefix length, own length): each group is one kernel call.

    RL batches hold many short samples of few distinct shapes; one kernel call per sequence would spend its time
    in dispatch (256 calls per layer for a 256-sample CPU batch), one call per shape does not.
    """
    groups: dict[tuple[int, int], list[Segment]] = {}
    for segment in segments:
        groups.setdefault((segment.prefix, segment.end - segment.start), []).append(segment)
    return groups


def _attend_alike(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    prefix: int,
    span_length: int,
    members: list[Segment],
    *,
    dropout: float,
    scaling: float | None,
    sliding_window: int | None,
) -> tuple[Tensor, slice | Tensor]:
    """Attention of segments of one shape: [H, n * span_length, D] and the row positions it belongs at."""
    device = query.device
    if prefix == 0 and len(members) == 1:  # a length of its own: slice views, no gather
        positions: slice | Tensor = slice(members[0].start, members[0].end)
        attended = _causal_attention(query[:, :, positions], key[:, :, positions], value[:, :, positions],
                                     dropout=dropout, scaling=scaling, sliding_window=sliding_window)[0]
        return attended, positions
    own = torch.tensor([m.start for m in members], device=device)[:, None] + torch.arange(span_length, device=device)
    if prefix:  # keys: the root's first `prefix` tokens, then the segment itself
        roots = torch.tensor([m.root for m in members], device=device)[:, None] + torch.arange(prefix, device=device)
        keys = torch.cat([roots, own], dim=1)
    else:
        keys = own
    attended = _causal_attention(query[0][:, own].transpose(0, 1), key[0][:, keys].transpose(0, 1),
                                 value[0][:, keys].transpose(0, 1), dropout=dropout, scaling=scaling,
                                 sliding_window=sliding_window)
    return attended.transpose(0, 1).reshape(attended.shape[1], -1, attended.shape[-1]), own.reshape(-1)


def sequence_spans(position_ids: Tensor | None, length: int) -> list[tuple[int, int]]:
    """[start, end) of each run of the row: a new one begins wherever positions do not continue by +1."""
    return [(segment.start, segment.end) for segment in packed_segments(position_ids, length)]


def _causal_attention(
    query: Tensor, key: Tensor, value: Tensor, *, dropout: float, scaling: float | None, sliding_window: int | None
) -> Tensor:
    """Queries are the last `query_length` of the keys' positions (all of them for a plain sequence)."""
    query_length, key_length = query.shape[2], key.shape[2]
    mask = None
    window = sliding_window is not None and key_length > sliding_window
    if window or key_length != query_length:
        rows = torch.arange(key_length - query_length, key_length, device=query.device)
        distance = rows[:, None] - torch.arange(key_length, device=query.device)[None, :]
        mask = (distance >= 0) & (distance < sliding_window) if window else distance >= 0
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
