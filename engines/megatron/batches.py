"""How the Megatron trainer lays out a batch: data-parallel shards, micro-batches, packed or padded rows.

Data. Every rank receives the WHOLE batch and takes its data-parallel shard itself (`shard_for_rank`), so all
ranks of one pipeline see identical micro-batches without exchanging data, and the caller needs no knowledge of
the TP/PP/DP layout. (The torch trainer differs: each of its ranks is handed its own shard.)

Rows. Two layouts, chosen by `qkv_format` (slime trains with the first; the second stays for comparison):
- "thd", packed (the default): a micro-batch is ONE row, its samples laid end to end, with their boundaries in
  megatron's `PackedSeqParams` (`cu_seqlens`). Attention keeps each sample to itself and rotary positions restart
  at 0 for each (megatron applies them per sequence from `cu_seqlens`); transformer-engine's attention and our
  `SdpaAttention` both read that layout. No token is spent on padding except at the end of the row, to a
  multiple of `pad_multiple`, and that tail is a sequence of its own that no real token sees. Samples go into
  packs as the torch trainer groups its micro-batches (`engines.training.micro_batches.plan_micro_batches`).
- "bshd", padded: each sample gets its own row, right-padded to the micro-batch's longest sample. Under a causal
  mask padding at the END of a row can never influence the real tokens before it, so the default causal mask is
  exact. The price is the padding itself; micro-batches group samples of similar length (longest first).
Either way `micro_batch_tokens` bounds the tokens of one forward pass, padding included. With sequence
parallelism megatron splits each row's sequence over the TP ranks, so rows are padded to a multiple of the TP size
(`pad_multiple`); the extra padding sits at the end, so it changes nothing.

Device. Every tensor of a micro-batch (model inputs, the logit selectors, the targets and the loss-side fields)
lives on `device`, the model's device: megatron's embedding indexes its CUDA weight with `input_ids`, the logit
selection indexes CUDA logits, and the loss multiplies CUDA log-probs with the loss-side fields. The rows are
assembled on the CPU (cheap, many tiny tensors) and moved in one copy per tensor. Only `response_lengths`, which
the host uses to split results, stays a Python tuple.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from engines.training.base import PackedBatch, TrainSample
from engines.training.micro_batches import collate
from engines.training.micro_batches import plan_micro_batches as plan_balanced_packs

if TYPE_CHECKING:
    from megatron.core.packed_seq_params import PackedSeqParams

PAD_TOKEN = 0  # any id works: right padding is never attended to by real tokens
QKV_FORMATS = ("thd", "bshd")


@dataclass(frozen=True)
class MicroBatch:
    """One forward pass: rows of samples (or one packed row) and where their response logits sit."""

    members: list[int]  # indices into the caller's sample list, in packed order
    input_ids: Tensor  # [B, S]; packed: [1, T], one row
    position_ids: Tensor  # [B, S]; packed: each sample's positions restart at 0
    logit_rows: Tensor  # [N]
    logit_columns: Tensor  # [N]: (row, column) of the logits that predict the N response tokens
    targets: Tensor  # [N]
    response_lengths: tuple[int, ...]  # [B], on the host: how the caller splits the N results per sample
    batch: PackedBatch | None  # loss-side fields (training only)
    packed_seq_params: PackedSeqParams | None = None  # "thd" only: where each sample starts in the one row
    # Routing replay: the experts of each token in megatron's token order (sequence-major: [S x B, layers, k]) and
    # which tokens have them; None when the samples carry no routes (`engines.megatron.experts.RoutingReplay`).
    routes: Tensor | None = None
    replayed: Tensor | None = None
    token_starts: tuple[tuple[int, int], ...] = ()  # (row, column) of each member's first token

    @property
    def is_filler(self) -> bool:
        """A forward that carries no sample (`filler_micro_batch`)."""
        return not self.members

    def tensors(self) -> dict[str, Tensor]:
        """Every tensor the model or the loss reads (what must sit on the model's device)."""
        fields = {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "logit_rows": self.logit_rows,
            "logit_columns": self.logit_columns,
            "targets": self.targets,
        }
        if self.packed_seq_params is not None:
            fields["cu_seqlens"] = self.packed_seq_params.cu_seqlens_q
        if self.routes is not None and self.replayed is not None:
            fields.update(routes=self.routes, replayed=self.replayed)
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


def plan_micro_batches(
    samples: Sequence[TrainSample],
    members: Sequence[int],
    token_budget: int,
    *,
    qkv_format: str,
    with_batch: bool,
    device: torch.device | str = "cpu",
    pad_multiple: int = 1,
) -> list[MicroBatch]:
    """`members` in micro-batches of at most `token_budget` tokens each (a longer sample goes alone), laid out
    as `qkv_format` says (see the module docstring), their tensors on `device`."""
    if pad_multiple < 1:
        raise ValueError(f"pad_multiple must be >= 1, got {pad_multiple}")
    if qkv_format not in QKV_FORMATS:
        raise ValueError(f"qkv_format must be one of {QKV_FORMATS}, got {qkv_format!r}")
    lengths = [int(samples[index].tokens.numel()) for index in members]
    groups = _groups(lengths, token_budget, qkv_format, pad_multiple)
    build = _pack if qkv_format == "thd" else _pad
    device = torch.device(device)
    return [build([members[p] for p in sorted(group)], samples, with_batch, device, pad_multiple) for group in groups]


def _groups(lengths: list[int], token_budget: int, qkv_format: str, pad_multiple: int) -> list[list[int]]:
    """Positions in `lengths` grouped into micro-batches, as `qkv_format` lays them out."""
    if qkv_format == "thd":
        # The torch trainer's plan: as few packs as first-fit finds, balanced. Router losses are per micro-batch,
        # so the same plan is what makes a MoE step the same on both backends.
        return plan_balanced_packs(lengths, token_budget)
    return _similar_length_rows([_round_up(n, pad_multiple) for n in lengths], token_budget)


def micro_batch_counts(
    lengths: Sequence[int], ranks: int, token_budget: int, *, qkv_format: str, pad_multiple: int = 1
) -> list[int]:
    """How many micro-batches each of `ranks` data-parallel ranks runs for samples of these token `lengths`: every
    rank plans every rank's shard the same way (`shard_for_rank`, `plan_micro_batches`), so no rank has to ask."""
    return [len(_groups([lengths[index] for index in shard_for_rank(lengths, ranks, rank)], token_budget,
                        qkv_format, pad_multiple)) for rank in range(ranks)]


def filler_micro_batch(width: int, *, qkv_format: str, device: torch.device | str = "cpu") -> MicroBatch:
    """A forward of `width` padding tokens and no sample. Under expert parallelism every forward exchanges tokens
    with the other data-parallel ranks of its expert group, so all of them must run as many forwards; a rank with
    fewer micro-batches runs these until it has as many (the trainer gives them no loss and no router loss)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    device = torch.device(device)
    empty = torch.zeros(0, dtype=torch.long, device=device)
    packed = None
    if qkv_format == "thd":
        cu_seqlens = torch.tensor([0, width], dtype=torch.int32, device=device)
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                                 max_seqlen_q=width, max_seqlen_kv=width)
    return MicroBatch(
        members=[],
        input_ids=torch.full((1, width), PAD_TOKEN, dtype=torch.long, device=device),
        position_ids=torch.arange(width, device=device)[None],
        logit_rows=empty,
        logit_columns=empty,
        targets=empty,
        response_lengths=(),
        batch=None,
        packed_seq_params=packed,
    )


def _similar_length_rows(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Groups whose padded size (rows x longest row) stays within `token_budget`, samples of similar length
    together."""
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for position in sorted(range(len(lengths)), key=lambda p: (-lengths[p], p)):
        candidate = max(longest, lengths[position])
        if current and candidate * (len(current) + 1) > token_budget:
            groups.append(current)
            current, candidate = [], lengths[position]
        current.append(position)
        longest = candidate
    if current:
        groups.append(current)
    return groups


def _token_routes(chunk: list[TrainSample], starts: list[tuple[int, int]], shape: tuple[int, int],
                  device: torch.device) -> tuple[Tensor, Tensor] | None:
    """The samples' `routed_experts` laid out as their tokens are (sample i's first token at `starts[i]` = (row,
    column) of a [B, S] `shape`), flattened in megatron's sequence-major token order; None without routes."""
    carried = [sample.routed_experts for sample in chunk]
    if all(routes is None for routes in carried):
        return None
    missing = [index for index, routes in enumerate(carried) if routes is None]
    if missing:
        raise ValueError(f"routing replay: samples {missing[:5]} of a micro-batch carry no routes while others do")
    present = [routes for routes in carried if routes is not None]
    routes = torch.zeros((*shape, *present[0].shape[1:]), dtype=torch.long)
    replayed = torch.zeros(shape, dtype=torch.bool)
    for (row, column), sample_routes in zip(starts, present, strict=True):
        routes[row, column : column + sample_routes.shape[0]] = sample_routes.long()
        replayed[row, column : column + sample_routes.shape[0]] = True
    return (routes.transpose(0, 1).reshape(-1, *routes.shape[2:]).to(device),
            replayed.transpose(0, 1).reshape(-1).to(device))


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _pad(
    members: list[int], samples: Sequence[TrainSample], with_batch: bool, device: torch.device, pad_multiple: int
) -> MicroBatch:
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
    starts = tuple((row, 0) for row in range(len(chunk)))
    routes = _token_routes(chunk, list(starts), (len(chunk), width), device)
    return MicroBatch(
        members=members,
        input_ids=input_ids.to(device),
        position_ids=torch.arange(width).expand(len(chunk), width).contiguous().to(device),
        logit_rows=torch.cat(rows).to(device),
        logit_columns=torch.cat(columns).to(device),
        targets=torch.cat(targets).to(device),
        response_lengths=tuple(sample.response_length for sample in chunk),
        batch=collate(chunk, device=device) if with_batch else None,
        routes=None if routes is None else routes[0],
        replayed=None if routes is None else routes[1],
        token_starts=starts,
    )


def _pack(
    members: list[int], samples: Sequence[TrainSample], with_batch: bool, device: torch.device, pad_multiple: int
) -> MicroBatch:
    from megatron.core.packed_seq_params import PackedSeqParams

    chunk = [samples[index] for index in members]
    edges = [0, *itertools.accumulate(int(sample.tokens.numel()) for sample in chunk)]
    total = _round_up(edges[-1], pad_multiple)
    if total > edges[-1]:
        edges.append(total)  # the padding tail: a sequence of its own, invisible to every real token
    input_ids = torch.full((1, total), PAD_TOKEN, dtype=torch.long)
    position_ids = torch.zeros((1, total), dtype=torch.long)
    columns, targets = [], []
    for start, end, sample in zip(edges, edges[1:], chunk, strict=False):
        input_ids[0, start:end] = sample.tokens.long()
        position_ids[0, start:end] = torch.arange(end - start)
        first = start + sample.prompt_length - 1
        columns.append(torch.arange(first, first + sample.response_length))
        targets.append(sample.tokens[sample.prompt_length :].long())
    if total > edges[len(chunk)]:
        position_ids[0, edges[len(chunk)] :] = torch.arange(total - edges[len(chunk)])
    logit_columns = torch.cat(columns)
    cu_seqlens = torch.tensor(edges, dtype=torch.int32, device=device)  # int32: transformer-engine's dtype
    longest = max(b - a for a, b in itertools.pairwise(edges))
    starts = tuple((0, start) for start in edges[: len(chunk)])
    routes = _token_routes(chunk, list(starts), (1, total), device)
    return MicroBatch(
        members=members,
        input_ids=input_ids.to(device),
        position_ids=position_ids.to(device),
        logit_rows=torch.zeros_like(logit_columns).to(device),
        logit_columns=logit_columns.to(device),
        targets=torch.cat(targets).to(device),
        response_lengths=tuple(sample.response_length for sample in chunk),
        batch=collate(chunk, device=device) if with_batch else None,
        packed_seq_params=PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_kv=cu_seqlens,
            max_seqlen_q=longest,
            max_seqlen_kv=longest,
        ),
        routes=None if routes is None else routes[0],
        replayed=None if routes is None else routes[1],
        token_starts=starts,
    )
