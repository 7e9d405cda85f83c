"""`packed_sdpa`: variable-length attention for packed rows, without flash-attention.

transformers handles a packed row (position_ids restarting at 0) under `sdpa` by building a block-diagonal
[T, T] mask, so the kernel still computes every cross-sequence score and throws it away; on a 4k-token row of
heavy-tailed samples that is most of the attention work (measured 3x slower end to end on CPU). This
implementation cuts the row at the restarts and runs causal sdpa on the sequences alone, those of equal length
batched into one call: only Σ L_i² scores, no mask tensor at all. It is what flash-attention's varlen path does,
for machines without flash-attention. On a GPU, a bf16/fp16 row of plain sequences goes to torch's own flash varlen
kernel (`torch.nn.attention.varlen`) in one call instead: the per-shape gathers and their backward's `index_add_`
were most of the torch trainer's kernel time over a bare HF step (docs/gpu.md, 2026-11-27).

It also reads rows whose samples share tokens (`pack_inputs(share_prompts=True)`): a segment whose positions start
at p > 0 continues the segments before it that reach position p, so a prefix every prompt of the micro-batch
starts with (a system prompt) is computed once, the rest of a GRPO group's prompt once per group, and every
response attends to both. Its keys are those of the chain it continues and its own, gathered per (p, length)
shape into one call, with a causal mask aligned to the end. Flash-attention's varlen path and HF's masks would
read such a segment as a sequence of its own, which is why only this attention gets shared rows.

Scope: one packed row (batch size 1), as the trainer produces. transformers builds no mask for a custom
attention name, so a padded batch would silently lose its padding mask; that case is refused loudly instead.
Sliding windows are honoured; attention sinks and logit soft-capping are not supported (use "sdpa").
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from transformers import AttentionInterface

from engines.training.prefix_attention import prefix_causal_attention

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
    packed_plan: RowPlan | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Signature of a transformers attention function: q [1, H, T, D], k/v [1, H_kv, T, D] -> [1, T, H, D].
    `packed_plan`: the row's plan, made once per forward by `forward_packed` (else made here, per layer)."""
    if query.shape[0] != 1:
        raise ValueError(f"{NAME} attends within one packed row; got a batch of {query.shape[0]} rows (use 'sdpa')")
    if softcap is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError(f"{NAME} does not support logit soft-capping or attention sinks; use 'sdpa'")
    length = query.shape[2]
    plan = packed_plan if packed_plan is not None and packed_plan.length == length else RowPlan(
        position_ids, length, query.device)
    dropout = dropout if module.training else 0.0
    if plan.varlen is not None and dropout == 0 and sliding_window is None and query.dtype in VARLEN_DTYPES:
        return _varlen_attention(query, key, value, plan.varlen, scaling), None
    key, value = plan.keys_values(key, value)
    output: Tensor | None = None
    for call in plan.calls:
        if isinstance(call.queries, slice):  # one run of rows: slice views, no gather
            q = query[:, :, call.queries]
            if isinstance(call.keys, slice):
                k, v = key[:, :, call.keys], value[:, :, call.keys]
            else:
                k, v = key.index_select(2, call.keys), value.index_select(2, call.keys)
        else:
            q = _rows(query[0], call.queries).transpose(0, 1)
            k, v = _rows(key[0], call.keys).transpose(0, 1), _rows(value[0], call.keys).transpose(0, 1)
        windowed = sliding_window is not None and k.shape[2] > sliding_window
        if (k.shape[2] != q.shape[2] and q.shape[2] * k.shape[2] >= PREFIX_KERNEL_ELEMENTS and not windowed
                and dropout == 0):  # long queries after a prefix: no [queries x keys] mask
            attended = prefix_causal_attention(q, k, v, scaling)
        else:
            attended = _sdpa(q, k, v, plan.mask(q.shape[2], k.shape[2], sliding_window), dropout, scaling)
        if plan.single:
            return attended.transpose(1, 2).contiguous(), None
        attended = attended.transpose(0, 1).reshape(attended.shape[1], -1, attended.shape[-1])
        if output is None:  # the kernel's dtype, which autocast may have changed from the inputs'
            output = attended.new_empty(attended.shape[0], length, attended.shape[-1])
        output[:, call.rows] = attended
    assert output is not None
    return output.unsqueeze(0).transpose(1, 2).contiguous(), None


VARLEN_DTYPES = (torch.bfloat16, torch.float16)  # flash attention's; float32 rows keep SDPA
# A call of queries after a prefix at least this big ([queries x keys]) goes to `prefix_causal_attention`. Below it
# the masked kernel's one call beat the prefix kernel's two calls and their join (CPU, forward and backward: 1.8x
# faster for 8 responses of 40 tokens after 60, even at 512 x 1,536); above it the prefix kernel won (1.4x at
# 2k x 2k, 1.3x-1.8x at 4k x 16k) and holds no mask.
PREFIX_KERNEL_ELEMENTS = 1 << 20
# A masked kernel call at least this big ([queries x keys], 16 MiB as floats) is recomputed in the backward
RECOMPUTED_MASK_ELEMENTS = 1 << 22


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout: float, scaling: float | None) -> Tensor:
    if mask is not None and mask.numel() >= RECOMPUTED_MASK_ELEMENTS and torch.is_grad_enabled():
        # A masked call (a sliding window, or dropout after a prefix) keeps a [queries x keys] float copy of its
        # mask for the backward, per layer: O(T^2) for a long row. Recomputed in the backward, it keeps q, k, v.
        return checkpoint(_masked_sdpa, q, k, v, mask, dropout, scaling, use_reentrant=False)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None,
                                          scale=scaling, enable_gqa=k.shape[1] != q.shape[1])


def _masked_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, dropout: float, scaling: float | None) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                          enable_gqa=k.shape[1] != q.shape[1])


@functools.cache
def varlen_kernel() -> tuple[Callable[..., Tensor], dict[str, Any]] | None:
    """torch's flash varlen attention and the keywords that make it causal, or None where this torch lacks it.

    Its signature moved between releases (the GPU probe reads it: 2.11 has `window_size`, causal is (-1, 0), and
    takes fewer KV heads than query heads as they are); `SLIPSTREAM_NO_VARLEN=1` keeps SDPA."""
    if os.environ.get("SLIPSTREAM_NO_VARLEN"):
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    parameters = inspect.signature(varlen_attn).parameters
    if "is_causal" in parameters:
        return varlen_attn, {"is_causal": True}
    if "window_size" in parameters:
        return varlen_attn, {"window_size": (-1, 0)}
    return None


def _varlen_attention(query: Tensor, key: Tensor, value: Tensor, varlen: tuple[Tensor, int],
                      scaling: float | None) -> Tensor:
    """The whole row in one flash call: q [1, H, T, D], k/v [1, H_kv, T, D] -> [1, T, H, D]; no gathers, no
    padding, and no index_add_ in the backward."""
    kernel = varlen_kernel()
    assert kernel is not None
    function, causal = kernel
    bounds, longest = varlen
    q, k, v = (states[0].transpose(0, 1).contiguous() for states in (query, key, value))
    return function(q, k, v, bounds, bounds, longest, longest, scale=scaling, **causal).unsqueeze(0)


def _rows(states: Tensor, index: Tensor) -> Tensor:
    """`states[:, index]` ([heads, T, D] -> [heads, *index.shape, D]) by `index_select`, not advanced indexing: a
    shared prompt's rows are gathered once per response, and advanced indexing's CPU backward accumulates such
    repeats with atomic adds from several threads, in whatever order they land (the same batch trained to other
    weights from run to run); `index_select`'s backward (`index_add_`) adds them in order."""
    return states.index_select(1, index.flatten()).unflatten(1, index.shape)


@dataclass(frozen=True)
class KernelCall:
    """Segments of one (prefix, length) shape: their query rows and key rows, gathered into one kernel call."""

    queries: slice | Tensor  # a slice for a lone run of rows; else [n, length] row indices
    # [n, prefix + length]: the root's first `prefix` rows, then the segment's own; with a slice of queries, a slice
    # or the key rows' indices (a context-parallel run: rows of the gathered whole row)
    keys: slice | Tensor
    rows: slice | Tensor  # where the outputs go in the row, flattened


class RowPlan:
    """How one packed row's attention is cut into kernel calls, with their index tensors and masks.

    It depends only on the row's positions, so `forward_packed` makes it once and every layer reads it: per layer
    it cost more than the attention kernels themselves on a CPU batch of short samples (a host transfer, index
    tensors and masks for each of a dozen shapes).
    """

    def __init__(self, position_ids: Tensor | None, length: int, device: torch.device,
                 starts: RowStarts | None = None) -> None:
        """`starts`: the row's `row_starts`, when the caller knows them on the host (`pack_inputs` does): then
        planning reads nothing back from the device."""
        self.length = length
        self._segments = packed_segments(position_ids, length, starts)
        self.single = len(self._segments) == 1
        self._calls: list[KernelCall] | None = None
        self._device = device
        self._masks: dict[tuple[int, int, int | None], Tensor | None] = {}
        # One flash varlen call for the whole row where it can: a CUDA row of plain sequences (no shared prompts)
        self.varlen: tuple[Tensor, int] | None = None
        if device.type == "cuda" and not self.single and varlen_kernel() is not None and all(
                segment.prefix == 0 for segment in self._segments):
            bounds = [segment.start for segment in self._segments] + [length]
            self.varlen = (torch.tensor(bounds, dtype=torch.int32).to(device, non_blocking=True),
                           max(segment.end - segment.start for segment in self._segments))

    def keys_values(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """The keys and values the calls index: the row's own (a context-parallel row gathers its group's)."""
        return key, value

    def join_tokens(self, values: Tensor) -> Tensor:
        """Per-token values of the response tokens this plan's forward computed, as the whole micro-batch's: the
        same (a context-parallel row gathers its group's)."""
        return values

    @property
    def calls(self) -> list[KernelCall]:
        """The SDPA kernel calls, built when first needed (a varlen row may never need them)."""
        if self._calls is None:
            self._calls = [_kernel_call(prefix, span, members, self._device)
                           for (prefix, span), members in _segments_by_shape(self._segments).items()]
        return self._calls

    def mask(self, query_length: int, key_length: int, sliding_window: int | None) -> Tensor | None:
        """None for plain causal attention; else queries are the last `query_length` of the keys' positions."""
        shape = (query_length, key_length, sliding_window)
        if shape not in self._masks:
            window = sliding_window is not None and key_length > sliding_window
            mask = None
            if window or key_length != query_length:
                rows = torch.arange(key_length - query_length, key_length, device=self._device)
                distance = rows[:, None] - torch.arange(key_length, device=self._device)[None, :]
                mask = (distance >= 0) & (distance < sliding_window) if window else distance >= 0
            self._masks[shape] = mask
        return self._masks[shape]


def _kernel_call(prefix: int, span_length: int, members: list[Segment], device: torch.device) -> KernelCall:
    if prefix == 0 and len(members) == 1:
        own = slice(members[0].start, members[0].end)
        return KernelCall(own, own, own)
    own_rows = torch.tensor([m.start for m in members], device=device)[:, None] + torch.arange(span_length,
                                                                                              device=device)
    keys = own_rows
    if prefix:
        context = torch.tensor([[row for start, end in m.context for row in range(start, end)] for m in members],
                               dtype=torch.int64, device=device)
        keys = torch.cat([context, own_rows], dim=1)
    return KernelCall(own_rows, keys, own_rows.reshape(-1))


@dataclass(frozen=True)
class Segment:
    """One run of the row whose positions count up by one: a sequence, or a continuation of shared tokens.

    A segment whose first position is 0 starts a sequence. One that starts at position p > 0 continues, after
    their first p positions, the segments before it that reach p (a response after its group's prompt, a group's
    prompt after the micro-batch's shared prefix): it attends to those p tokens (`context`, row spans in position
    order), then causally to itself.
    """

    start: int
    end: int
    prefix: int  # the first position: how many tokens of context it attends to before its own
    context: tuple[tuple[int, int], ...] = ()  # [start, end) row spans holding positions 0..prefix-1, in order


RowStarts = tuple[tuple[int, ...], tuple[int, ...]]  # (row positions where a run begins, the position there)


def row_starts(position_ids: Tensor, length: int) -> RowStarts:
    """Where the row's runs of +1 positions begin, and their first positions (a host read when on a device)."""
    positions = position_ids.reshape(-1)[:length]
    starts = torch.cat([positions.new_zeros(1), (positions[1:] != positions[:-1] + 1).nonzero().flatten().add(1)])
    start_list, firsts = torch.stack([starts, positions[starts]]).tolist()
    return tuple(start_list), tuple(firsts)


def packed_segments(position_ids: Tensor | None, length: int, starts: RowStarts | None = None) -> list[Segment]:
    """The row's segments, each with the chain of row spans it continues (see `Segment`)."""
    if position_ids is None and starts is None:
        return [Segment(0, length, 0)]
    if starts is None:
        assert position_ids is not None
        starts = row_starts(position_ids, length)  # the only host sync of planning a row
    start_list, firsts = starts
    if len(start_list) == 1:  # one sequence, wherever its positions begin
        return [Segment(0, length, 0)]
    segments: list[Segment] = []
    chain: list[tuple[int, int, int]] = []  # (row start, first position, end position) of the open segments
    for start, end, first in zip(start_list, [*start_list[1:], length], firsts, strict=True):
        while chain and chain[-1][1] >= first:
            chain.pop()
        if first > 0 and (not chain or chain[-1][2] < first):
            raise ValueError(f"{NAME}: packed positions restart at {first} (row position {start}) without "
                             f"segments before it that reach position {first} to continue")
        # each open segment holds the positions from its own first up to where the next one (or this) begins
        cuts = [begin for _, begin, _ in chain[1:]] + [first] if chain else []
        context = tuple((row, row + min(stop, cut) - begin)
                        for (row, begin, stop), cut in zip(chain, cuts, strict=True))
        segments.append(Segment(start, end, first, context))
        chain.append((start, first, first + end - start))
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


def sequence_spans(position_ids: Tensor | None, length: int) -> list[tuple[int, int]]:
    """[start, end) of each run of the row: a new one begins wherever positions do not continue by +1."""
    return [(segment.start, segment.end) for segment in packed_segments(position_ids, length)]


def register_packed_attention() -> None:
    """Make `attn_implementation="packed_sdpa"` known to transformers (idempotent; process-wide registry)."""
    AttentionInterface.register(NAME, packed_sdpa_attention)
