"""How the Megatron trainer lays out a batch: data-parallel shards, micro-batches, padded rows.

Data. Every rank receives the WHOLE batch and takes its data-parallel shard itself (`shard_for_rank`), so all
ranks of one pipeline see identical micro-batches without exchanging data, and the caller needs no knowledge of
the TP/PP/DP layout. (The torch trainer differs: each of its ranks is handed its own shard.)

Rows. megatron-core packs sequences only through `PackedSeqParams` in THD format, which only its
transformer-engine / flash-attention paths implement; its local attention applies rotary positions by row index
and takes an explicit mask. We therefore give each sample its own row, right-padded to the micro-batch's longest
sample. Under a causal mask padding at the END of a row can never influence the real tokens before it, so no
padding mask is needed, the default causal mask is exact, and rotary positions 0..L-1 match the HF model's.
The price is the padding itself; micro-batches group samples of similar length (longest first) to keep it small.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from engines.training.base import PackedBatch, TrainSample
from engines.training.packing import collate

PAD_TOKEN = 0  # any id works: right padding is never attended to by real tokens


@dataclass(frozen=True)
class PaddedMicroBatch:
    """One forward pass: rows of samples and where their response logits sit."""

    members: list[int]  # indices into the caller's sample list, in packed order
    input_ids: Tensor  # [B, S]
    position_ids: Tensor  # [B, S]
    logit_rows: Tensor  # [N]
    logit_columns: Tensor  # [N]: (row, column) of the logits that predict the N response tokens
    targets: Tensor  # [N]
    response_lengths: Tensor  # [B]
    batch: PackedBatch | None  # loss-side fields (training only)


def shard_for_rank(lengths: Sequence[int], ranks: int, rank: int) -> list[int]:
    """Indices of this data-parallel rank's samples: longest first onto the least-loaded rank (deterministic,
    so every rank computes every rank's shard identically). Ascending order inside a shard."""
    loads = [0] * ranks
    shards: list[list[int]] = [[] for _ in range(ranks)]
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        target = min(range(ranks), key=lambda r: (loads[r], r))
        shards[target].append(index)
        loads[target] += lengths[index]
    return sorted(shards[rank])


def plan_padded_micro_batches(
    samples: Sequence[TrainSample], members: Sequence[int], token_budget: int, *, with_batch: bool
) -> list[PaddedMicroBatch]:
    """Split `members` into micro-batches whose padded size (rows x longest row) stays within `token_budget`."""
    lengths = [int(samples[index].tokens.numel()) for index in members]
    plans: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for position in sorted(range(len(members)), key=lambda p: (-lengths[p], p)):
        candidate = max(longest, lengths[position])
        if current and candidate * (len(current) + 1) > token_budget:
            plans.append(current)
            current, candidate = [], lengths[position]
        current.append(position)
        longest = candidate
    if current:
        plans.append(current)
    return [_pad([members[p] for p in sorted(plan)], samples, with_batch) for plan in plans]


def _pad(members: list[int], samples: Sequence[TrainSample], with_batch: bool) -> PaddedMicroBatch:
    chunk = [samples[index] for index in members]
    width = max(int(sample.tokens.numel()) for sample in chunk)
    input_ids = torch.full((len(chunk), width), PAD_TOKEN, dtype=torch.long)
    rows, columns, targets = [], [], []
    for row, sample in enumerate(chunk):
        length = int(sample.tokens.numel())
        input_ids[row, :length] = sample.tokens.long()
        first = sample.prompt_length - 1
        columns.append(torch.arange(first, first + sample.response_length))
        rows.append(torch.full((sample.response_length,), row, dtype=torch.long))
        targets.append(sample.tokens[sample.prompt_length :].long())
    return PaddedMicroBatch(
        members=members,
        input_ids=input_ids,
        position_ids=torch.arange(width).expand(len(chunk), width).contiguous(),
        logit_rows=torch.cat(rows),
        logit_columns=torch.cat(columns),
        targets=torch.cat(targets),
        response_lengths=torch.tensor([sample.response_length for sample in chunk], dtype=torch.long),
        batch=collate(chunk) if with_batch else None,
    )
