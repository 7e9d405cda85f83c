"""Context parallelism for the torch trainer: one packed row split across the ranks of a group, keys gathered.

A row too long for one device's activations is cut among C ranks that all hold the same micro-batch. Each rank runs
the model on its own rows only (its own embeddings, MLPs, norms and head: activation memory falls as 1/C); attention
is the one place where a token needs the others, and there every layer all-gathers the keys and values of the whole
row (slime's `--allgather-cp` layout: one collective per layer, the K/V of the row held once per rank; a ring that
never holds them all is the later option). The gather's backward sums each key's gradient over the ranks whose
queries read it.

The split is zigzag, per sequence of the row: each sequence (each segment, with shared prompts) is cut into 2C
chunks and rank r keeps chunks r and 2C-1-r, so under causal attention every rank does about the same work, and
rows whose lengths do not divide evenly just give some chunks one token more.

The response tokens' log-probs (and entropy) are computed where their predicting row lives, then all-gathered so
every rank of the group holds the whole micro-batch's outputs in sample order and computes the same loss from them.
That gather's backward hands each rank the gradient of its own tokens only (the loss is replicated, not split), so
the parameter gradients of the ranks are disjoint parts of the true one; the trainer's data-parallel sum over the
world adds them up, exactly as it adds the parts of different samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from engines.training.attention import KernelCall, RowPlan, Segment, packed_segments
from engines.training.base import DataParallel
from engines.training.micro_batches import PackedInputs


@dataclass(frozen=True)
class ContextParallel:
    """This rank's context-parallel group: the ranks that split each row of the micro-batch it trains."""

    rank: int
    size: int
    group: Any  # the process group of those `size` ranks
    reduce_scatter: bool  # NCCL's; gloo has none, so a backward there all-reduces and keeps its own slice

    @classmethod
    def split_world(cls, size: int, device: torch.device) -> tuple[ContextParallel, DataParallel]:
        """The default group cut into context-parallel groups of `size` consecutive ranks, and the data-parallel
        groups across them (the ranks of one context-parallel group train the same samples). Collective: every rank
        calls it, creating every group in the same order, as `dist.new_group` requires."""
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % size:
            raise ValueError(f"context_parallel_size {size} does not divide the learner's {world} ranks; use a "
                             "world of data-parallel replicas x context-parallel ranks")
        context_groups = [dist.new_group(list(range(start, start + size))) for start in range(0, world, size)]
        data_groups = [dist.new_group(list(range(offset, world, size))) for offset in range(size)]
        nccl = dist.get_backend() == "nccl" and device.type == "cuda"
        context = cls(rank=rank % size, size=size, group=context_groups[rank // size], reduce_scatter=nccl)
        return context, DataParallel(rank=rank // size, size=world // size, group=data_groups[rank % size])

    def split_row(self, inputs: PackedInputs) -> PackedInputs:
        """This rank's part of a packed micro-batch: its rows' tokens and positions, the response tokens they
        predict, and the plan that joins the group's attention and outputs back into the whole row's."""
        length = inputs.input_ids.shape[-1]
        device = inputs.input_ids.device
        row = ContextRow(self, packed_segments(inputs.position_ids, length, inputs.row_starts), length,
                         inputs.logit_positions, device)
        return PackedInputs(input_ids=inputs.input_ids[:, row.rows], position_ids=inputs.position_ids[:, row.rows],
                            logit_positions=row.logit_rows, targets=inputs.targets[row.tokens],
                            response_lengths=inputs.response_lengths, context_row=row)


def zigzag_rows(segments: Sequence[Segment], size: int) -> list[list[int]]:
    """Per rank of `size`, the row positions it holds, ascending: chunks r and 2*size-1-r of every segment.

    Segments shorter than 2*size leave some chunks empty, and a row of a few short ones can leave a rank none of
    it; such a rank takes a row from the rank holding most (a model cannot run on no tokens). A row of fewer tokens
    than ranks cannot be split at all, and is refused naming both."""
    length = max((segment.end for segment in segments), default=0)
    if length < size:
        raise ValueError(f"context parallelism: a packed row of {length} tokens cannot be split across {size} "
                         "ranks (each needs a token); lower context_parallel_size or train longer rows")
    held: list[list[int]] = [[] for _ in range(size)]
    chunks = 2 * size
    for segment in segments:
        span = segment.end - segment.start
        bounds = [segment.start + span * index // chunks for index in range(chunks + 1)]
        for rank in range(size):
            for chunk in (rank, chunks - 1 - rank):
                held[rank].extend(range(bounds[chunk], bounds[chunk + 1]))
    for rows in held:
        if not rows:
            donor = max(held, key=len)
            rows.append(donor.pop())
    return [sorted(rows) for rows in held]


class ContextRow(RowPlan):
    """One packed row as this rank of its context-parallel group sees it: the rows it holds, where each row of the
    whole row sits in the gathered keys, which response tokens it computes, and its attention's kernel calls
    (its queries against the gathered keys; `packed_sdpa_attention` runs them as it runs a row's own)."""

    def __init__(self, context: ContextParallel, segments: list[Segment], length: int, logit_positions: Tensor,
                 device: torch.device) -> None:
        self.context = context
        held = zigzag_rows(segments, context.size)
        self.width = max(len(rows) for rows in held)
        own = held[context.rank]
        self.rows = torch.tensor(own, dtype=torch.long, device=device)  # this rank's rows of the whole row
        # where row t of the whole row lands in the gathered [ranks x width] keys, flattened
        place = torch.empty(length, dtype=torch.long)
        owner = torch.empty(length, dtype=torch.long)
        local = torch.empty(length, dtype=torch.long)
        for rank, rows in enumerate(held):
            index = torch.tensor(rows, dtype=torch.long)
            place[index] = rank * self.width + torch.arange(len(rows))
            owner[index] = rank
            local[index] = torch.arange(len(rows))
        self.key_order = place.to(device)
        # Response token j is computed by the rank holding the row that predicts it.
        predictors = logit_positions.cpu()
        token_owner = owner[predictors]
        tokens = [(token_owner == rank).nonzero().flatten() for rank in range(context.size)]
        self.token_width = max(max(int(mine.numel()) for mine in tokens), 1)
        order = torch.empty(predictors.numel(), dtype=torch.long)
        for rank, mine in enumerate(tokens):
            order[mine] = rank * self.token_width + torch.arange(mine.numel())
        self.token_order = order.to(device)
        self.tokens = tokens[context.rank].to(device)  # which of the micro-batch's response tokens are ours
        self.logit_rows = local[predictors[tokens[context.rank]]].to(device)  # and the local rows predicting them
        # RowPlan's state: the mask cache and the calls, over this rank's rows; never one flash varlen call
        self.length = len(own)
        self.single = False
        self.varlen = None
        self._device = device
        self._masks = {}
        self._calls = _calls(segments, own, device)

    def join_rows(self, values: Tensor) -> Tensor:
        """Per-row values of the rows this rank holds ([rows held, ...]) -> the whole row's, on every rank of the
        group; no gradient (the experts each token was routed to, which `moe.sample_routes` reads per sample)."""
        padding = (0, 0) * (values.dim() - 1) + (0, self.width - values.shape[0])
        gathered = _all_gather(torch.nn.functional.pad(values, padding).contiguous(), self.context)
        return gathered.reshape(-1, *values.shape[1:]).index_select(0, self.key_order)

    def keys_values(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Every rank's keys and values ([1, H_kv, rows held, D] each), as the whole row's, in row order."""
        heads = key.shape[1]
        both = torch.cat([key, value], dim=1)[0]
        padded = torch.nn.functional.pad(both, (0, 0, 0, self.width - both.shape[1]))
        gathered = _GatherSummingBack.apply(padded.contiguous(), self.context)  # [ranks, 2 H_kv, width, D]
        whole = gathered.transpose(0, 1).reshape(2 * heads, -1, both.shape[-1]).index_select(1, self.key_order)
        return whole[None, :heads], whole[None, heads:]

    def join_tokens(self, values: Tensor) -> Tensor:
        """This rank's response tokens' values -> the micro-batch's, in sample order, on every rank."""
        padded = torch.nn.functional.pad(values, (0, self.token_width - values.shape[0]))
        gathered = _GatherOwnSliceBack.apply(padded.contiguous(), self.context)  # [ranks, token width]
        return gathered.reshape(-1).index_select(0, self.token_order)


def _calls(segments: list[Segment], own: list[int], device: torch.device) -> list[KernelCall]:
    """One kernel call per run of consecutive held rows within a segment: its queries (local rows), its keys (the
    segment's context, then the segment's rows up to the run's end, as rows of the whole row) and where its outputs
    go. A run's queries are the last of its keys, so the plan's bottom-right causal mask is the right one."""
    calls: list[KernelCall] = []
    position = 0  # the local row: an index into `own`
    for segment in segments:
        context = [row for begin, end in segment.context for row in range(begin, end)]
        while position < len(own) and own[position] < segment.end:
            first = position
            position += 1
            while position < len(own) and own[position] == own[position - 1] + 1 and own[position] < segment.end:
                position += 1
            keys = torch.tensor([*context, *range(segment.start, own[position - 1] + 1)], dtype=torch.long,
                                device=device)
            calls.append(KernelCall(slice(first, position), keys, slice(first, position)))
    return calls


class _GatherSummingBack(torch.autograd.Function):
    """All-gather along a new first dimension; the backward sums the gradient over the group and keeps this rank's
    part (each rank's queries read every rank's keys)."""

    @staticmethod
    def forward(ctx, local: Tensor, context: ContextParallel) -> Tensor:
        ctx.context = context
        return _all_gather(local, context)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        context: ContextParallel = ctx.context
        grad = grad.contiguous()
        if context.reduce_scatter:
            mine = grad.new_empty(grad.shape[1:])
            dist.reduce_scatter_tensor(mine, grad, group=context.group)
            return mine, None
        dist.all_reduce(grad, group=context.group)
        return grad[context.rank].clone(), None


class _GatherOwnSliceBack(torch.autograd.Function):
    """All-gather along a new first dimension; the backward keeps this rank's part of the gradient as it is: every
    rank computes the same loss from the gathered values, so its own part is already the whole of it."""

    @staticmethod
    def forward(ctx, local: Tensor, context: ContextParallel) -> Tensor:
        ctx.rank = context.rank
        return _all_gather(local, context)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad[ctx.rank].clone(), None


def _all_gather(local: Tensor, context: ContextParallel) -> Tensor:
    gathered = local.new_empty((context.size, *local.shape))
    if context.reduce_scatter:  # NCCL: one tensor in, one out
        dist.all_gather_into_tensor(gathered, local, group=context.group)
    else:
        dist.all_gather(list(gathered.unbind(0)), local, group=context.group)
    return gathered
