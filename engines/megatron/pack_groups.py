"""How `SdpaAttention` runs a pack's sequences in a few SDPA calls rather than one call per sequence.

A pack (THD) holds many sequences end to end, and each must attend causally to itself alone. One SDPA call per
sequence is exact but costs a kernel launch (and Python) per sequence per layer: an RL batch of 256 short
answers made a packed step 3.7x slower than padded rows on the CPU. So the sequences are grouped by length, and
each group runs as one right-padded batch [sequences, heads, longest, hn] under the causal mask. That stays
exact: a real query at position i sees keys 0..i of its own row only, and right padding sits after every real
token; the padded queries' outputs are dropped. A group grows, longest sequence first, while its padded
attention work (sequences x longest^2) stays within `SLACK` times the work of its sequences alone (sum of
length^2), so padding costs attention at most 25% over the exact amount, and the linear layers none.

The plan depends only on the pack's boundaries, which every layer shares, so it is built once per micro-batch
(`plan_for`, keyed by the `cu_seqlens` tensor itself) and its index tensors live on the model's device.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

SLACK = 1.25


@dataclass(frozen=True)
class LengthGroup:
    """Sequences of similar length, run as one right-padded batch."""

    gather: Tensor  # [sequences, longest]: token positions in the pack; padded slots repeat the row's first token
    valid: Tensor  # [sequences, longest] bool: which slots are real tokens


@dataclass(frozen=True)
class PackPlan:
    groups: tuple[LengthGroup, ...]
    order: Tensor  # [t]: row of the concatenated group outputs (real slots, group by group) for each pack token


def group_spans(spans: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """(start, end) spans of non-empty sequences -> groups, longest first (see the module docstring)."""
    groups: list[list[tuple[int, int]]] = []
    exact_work = 0
    for span in sorted(spans, key=lambda s: (-(s[1] - s[0]), s[0])):
        length = span[1] - span[0]
        if groups:
            longest = groups[-1][0][1] - groups[-1][0][0]
            if (len(groups[-1]) + 1) * longest**2 <= SLACK * (exact_work + length**2):
                groups[-1].append(span)
                exact_work += length**2
                continue
        groups.append([span])
        exact_work = length**2
    return groups


def build_plan(edges: list[int], device: torch.device) -> PackPlan:
    """The plan for a pack with these boundaries (`cu_seqlens` as a list)."""
    spans = [(start, end) for start, end in itertools.pairwise(edges) if end > start]
    groups, positions = [], []
    for members in group_spans(spans):
        longest = members[0][1] - members[0][0]
        offsets = torch.arange(longest)
        starts = torch.tensor([start for start, _ in members]).unsqueeze(1)
        lengths = torch.tensor([end - start for start, end in members]).unsqueeze(1)
        valid = offsets < lengths
        gather = torch.where(valid, starts + offsets, starts)
        groups.append(LengthGroup(gather=gather.to(device), valid=valid.to(device)))
        positions.append(gather[valid])  # row-major: sequence by sequence, the order `ctx[valid]` returns
    order = torch.empty(edges[-1], dtype=torch.long)
    order[torch.cat(positions)] = torch.arange(edges[-1])
    return PackPlan(groups=tuple(groups), order=order.to(device))


_cache_lock = threading.Lock()
_cached: tuple[weakref.ref[Tensor], int, torch.device, PackPlan] | None = None


def plan_for(cu_seqlens: Tensor, tokens: int, device: torch.device) -> PackPlan:
    """`build_plan` for a pack of `tokens` tokens, once per boundary tensor: every layer of a forward (and of a
    recomputed forward) shares it, and only the first reads the boundaries back from the device."""
    global _cached
    with _cache_lock:
        if _cached is not None and _cached[0]() is cu_seqlens and _cached[1:3] == (tokens, device):
            return _cached[3]
        edges = [int(edge) for edge in cu_seqlens.tolist()]
        if not edges or edges[0] != 0 or edges[-1] != tokens or any(b < a for a, b in itertools.pairwise(edges)):
            raise ValueError(f"SdpaAttention: cu_seqlens {edges} do not partition the pack's {tokens} tokens")
        plan = build_plan(edges, device)
        _cached = (weakref.ref(cu_seqlens), tokens, device, plan)
        return plan
