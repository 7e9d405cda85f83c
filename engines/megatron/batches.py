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
With sequence parallelism megatron splits each row's sequence over the TP ranks, so rows are padded to a multiple
of the TP size (`pad_multiple`); the extra padding sits at the end too, so it changes nothing either.

Device. Every tensor of a micro-batch (model inputs, the logit selectors, the targets and the loss-side fields)
lives on `device`, the model's device: megatron's embedding indexes its CUDA weight with `input_ids`, the logit
selection indexes CUDA logits, and the loss multiplies CUDA log-probs with the loss-side fields. The rows are
assembled on the CPU (cheap, many tiny tensors) and moved in one copy per tensor. Only `response_lengths`, which
the host uses to split results, stays a Python tuple.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from engines.training.base import PackedBatch, TrainSample
from engines.training.micro_batches import collate

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
    response_lengths: tuple[int, ...]  # [B], on the host: how the caller splits the N results per sample
    batch: PackedBatch | None  # loss-side fields (training only)

    def tensors(self) -> dict[str, Tensor]:
        """Every tensor the model or the loss reads (what must sit on the model's device)."""
        fields = {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "logit_rows": self.logit_rows,
            "logit_columns": self.logit_columns,
            "targets": self.targets,
        }
        if self.batch is not None:
            fields.update({f"batch.{name}": tensor for name, tensor in self.batch.tensors().items()})
        return fields


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
    samples: Sequence[TrainSample],
    members: Sequence[int],
    token_budget: int,
    *,
    with_batch: bool,
    device: torch.device | str = "cpu",
    pad_multiple: int = 1,
) -> list[PaddedMicroBatch]:
    """Split `members` into micro-batches whose padded size (rows x longest row) stays within `token_budget`,
    their tensors on `device`, each row's width rounded up to a multiple of `pad_multiple`."""
    if pad_multiple < 1:
        raise ValueError(f"pad_multiple must be >= 1, got {pad_multiple}")
    lengths = [_round_up(int(samples[index].tokens.numel()), pad_multiple) for index in members]
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
    device = torch.device(device)
    return [_pad([members[p] for p in sorted(plan)], samples, with_batch, device, pad_multiple) for plan in plans]


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _pad(
    members: list[int], samples: Sequence[TrainSample], with_batch: bool, device: torch.device, pad_multiple: int
) -> PaddedMicroBatch:
    chunk = [samples[index] for index in members]
    width = _round_up(max(int(sample.tokens.numel()) for sample in chunk), pad_multiple)
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
        input_ids=input_ids.to(device),
        position_ids=torch.arange(width).expand(len(chunk), width).contiguous().to(device),
        logit_rows=torch.cat(rows).to(device),
        logit_columns=torch.cat(columns).to(device),
        targets=torch.cat(targets).to(device),
        response_lengths=tuple(sample.response_length for sample in chunk),
        batch=collate(chunk, device=device) if with_batch else None,
    )
