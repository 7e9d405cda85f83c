"""Loop-based float64 reference implementations the vectorised policies code is checked against.

Written for clarity, one sample and one token at a time, straight from the formulas in docs/policies.md; they share
no code with ``policies/``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Batch:
    """A random packed batch: per-sample python lists plus the packed tensors."""

    lengths: list[int]
    masks: list[list[float]]
    groups: list[int]

    @property
    def response_lengths(self) -> Tensor:
        return torch.tensor(self.lengths, dtype=torch.long)

    @property
    def loss_mask(self) -> Tensor:
        return torch.tensor([m for mask in self.masks for m in mask], dtype=torch.float64)

    @property
    def group_ids(self) -> Tensor:
        return torch.tensor(self.groups, dtype=torch.long)

    @property
    def total(self) -> int:
        return sum(self.lengths)


def random_batch(seed: int, n_groups: int = 4, max_group: int = 4, max_len: int = 9) -> Batch:
    """Uneven groups in shuffled order, random masks, and always: a length-1 sample, an all-masked sample,
    a singleton group."""
    gen = torch.Generator().manual_seed(seed)
    groups: list[int] = []
    for g in range(n_groups):
        size = 1 if g == 0 else int(torch.randint(2, max_group + 1, (1,), generator=gen))
        groups += [g * 7 + 3] * size  # arbitrary, non-contiguous ids
    order = torch.randperm(len(groups), generator=gen).tolist()
    groups = [groups[i] for i in order]
    lengths, masks = [], []
    for i in range(len(groups)):
        length = 1 if i == 0 else int(torch.randint(1, max_len + 1, (1,), generator=gen))
        mask = [float(x) for x in (torch.rand(length, generator=gen) > 0.25).tolist()]
        if i == 1:
            mask = [0.0] * length  # all-masked sample
        if i == 0:
            mask = [1.0]
        lengths.append(length)
        masks.append(mask)
    return Batch(lengths=lengths, masks=masks, groups=groups)


def packed_random(batch: Batch, seed: int, scale: float = 1.0, shift: float = 0.0) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch.total, generator=gen, dtype=torch.float64) * scale + shift


def per_sample(t: Tensor, batch: Batch) -> list[list[float]]:
    out, start = [], 0
    for length in batch.lengths:
        out.append(t[start : start + length].tolist())
        start += length
    return out


def flat(rows: list[list[float]]) -> Tensor:
    return torch.tensor([x for row in rows for x in row], dtype=torch.float64)


# ---------------------------------------------------------------- advantages


def group_normalize(rewards: list[float], groups: list[int], divide_by_std: bool, eps: float) -> list[float]:
    out = []
    for i, r in enumerate(rewards):
        members = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i]]
        mean = sum(members) / len(members)
        centred = r - mean
        if divide_by_std:
            spread = sum((m - mean) ** 2 for m in members)
            std = math.sqrt(spread / (len(members) - 1)) if len(members) > 1 else 0.0
            centred = centred / (std + eps)
        out.append(centred)
    return out


def leave_one_out(rewards: list[float], groups: list[int]) -> list[float]:
    out = []
    for i, r in enumerate(rewards):
        others = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i] and j != i]
        out.append(r - sum(others) / len(others) if others else 0.0)
    return out


def last_masked(mask: list[float]) -> int:
    for t in reversed(range(len(mask))):
        if mask[t] > 0:
            return t
    return len(mask) - 1


def discounted_returns(token_rewards: list[float], gamma: float) -> list[float]:
    out = [0.0] * len(token_rewards)
    running = 0.0
    for t in reversed(range(len(token_rewards))):
        running = token_rewards[t] + gamma * running
        out[t] = running
    return out


def gae(token_rewards: list[float], values: list[float], gamma: float, lambd: float) -> tuple[list, list]:
    advantages = [0.0] * len(values)
    running = 0.0
    for t in reversed(range(len(values))):
        next_value = values[t + 1] if t + 1 < len(values) else 0.0
        delta = token_rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lambd * running
        advantages[t] = running
    return advantages, [a + v for a, v in zip(advantages, values, strict=True)]


def whiten(values: list[list[float]], masks: list[list[float]], eps: float = 1e-8) -> list[list[float]]:
    kept = [v for row, mrow in zip(values, masks, strict=True) for v, m in zip(row, mrow, strict=True) if m > 0]
    mean = sum(kept) / len(kept)
    var = sum((v - mean) ** 2 for v in kept) / max(len(kept) - 1, 1)  # unbiased (Bessel), as slime
    return [
        [((v - mean) / math.sqrt(var + eps)) if m > 0 else 0.0 for v, m in zip(row, mrow, strict=True)]
        for row, mrow in zip(values, masks, strict=True)
    ]


# ---------------------------------------------------------------- losses


def ppo_token_loss(
    log_prob: float, old_log_prob: float, advantage: float, eps: float, eps_high: float, eps_c: float | None
) -> tuple[float, bool]:
    ratio = math.exp(log_prob - old_log_prob)
    clipped_ratio = min(max(ratio, 1 - eps), 1 + eps_high)
    loss = max(-ratio * advantage, -clipped_ratio * advantage)
    was_clipped = -clipped_ratio * advantage > -ratio * advantage
    if eps_c is not None and advantage < 0:
        loss = min(loss, -eps_c * advantage)
    return loss, was_clipped


def aggregate(per_token: list[list[float]], masks: list[list[float]], mode: str) -> float:
    if mode == "token-mean":
        num = sum(x * m for row, mrow in zip(per_token, masks, strict=True) for x, m in zip(row, mrow, strict=True))
        den = sum(m for mrow in masks for m in mrow)
        return num / max(den, 1.0)
    total, n_seqs = 0.0, 0
    for row, mrow in zip(per_token, masks, strict=True):
        count = sum(mrow)
        if count == 0:
            continue
        n_seqs += 1
        seq_sum = sum(x * m for x, m in zip(row, mrow, strict=True))
        total += seq_sum / count if mode == "seq-mean-token-mean" else seq_sum
    return total / max(n_seqs, 1)


def kl(kind: str, log_prob: float, ref_log_prob: float) -> float:
    d = log_prob - ref_log_prob
    if kind == "k1":
        return d
    if kind == "k2":
        return d * d / 2
    k3 = math.exp(-d) - 1 + d
    return k3 if kind == "k3" else min(max(k3, -10.0), 10.0)
