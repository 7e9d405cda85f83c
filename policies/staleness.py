"""Staleness control (``--max-staleness``): admission at the buffer, a re-check at consumption, a histogram.

Definitions (DESIGN.md): a policy version is the number of optimizer steps applied; every generated token carries
the version of the weights that produced it; a sample's staleness when consumed is
``learner_version - min(token versions)``.

Admission. Batch ``k`` (``B`` groups) is trained while the learner is at version ``k``. If groups are accepted
in the order they start, the group that starts ``n``-th (0-based) lands in batch ``n // B``; starting it while the
learner is at ``v`` gives staleness ``n // B - v``. Keeping ``n < (v + eta + 1) * B`` therefore bounds it by
``eta`` by construction, and ``eta = 0`` is exactly synchronous training: at version ``v`` the first ``(v + 1) * B``
groups may have started, i.e. precisely batch ``v``, and nothing of batch ``v + 1`` starts until the learner has
stepped. Groups a filter dropped never occupy a batch slot, so they are given back to the budget.

When groups finish out of start order, a later group can take an earlier group's slot and push it one batch
later; the consumption check (:func:`split_by_staleness`) is the backstop that keeps the bound hard either way.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

import torch
from torch import Tensor

from policies.packing import check_lengths, check_packed, sample_index

__all__ = [
    "AdmissionController",
    "StaleAction",
    "StalenessSplit",
    "sample_staleness",
    "split_by_staleness",
    "staleness_histogram",
    "token_staleness",
]


@dataclass(frozen=True)
class AdmissionController:
    """Pure admission rule; the buffer owns the counters and asks before leasing each group.

    ``max_staleness`` is eta (0 = synchronous), ``groups_per_batch`` is B (prompt groups per training batch).
    """

    max_staleness: int
    groups_per_batch: int

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness: must be >= 0, got {self.max_staleness}")
        if self.groups_per_batch < 1:
            raise ValueError(f"groups_per_batch: must be >= 1, got {self.groups_per_batch}")

    def budget(self, learner_version: int) -> int:
        """Total groups that may have started (and not been dropped) by the time the learner is at this version."""
        if learner_version < 0:
            raise ValueError(f"learner_version: must be >= 0, got {learner_version}")
        return (learner_version + self.max_staleness + 1) * self.groups_per_batch

    def capacity(self, *, learner_version: int, started_groups: int, dropped_groups: int = 0) -> int:
        """How many more groups may start now: ``(v + eta + 1) * B - (started - dropped)``, never negative.

        ``started_groups`` counts every group ever leased (in flight, accepted or dropped); ``dropped_groups``
        those a filter or a failure discarded, which never take a batch slot.
        """
        if started_groups < 0 or dropped_groups < 0 or dropped_groups > started_groups:
            raise ValueError(
                f"group counts: need 0 <= dropped_groups ({dropped_groups}) <= started_groups ({started_groups})"
            )
        return max(0, self.budget(learner_version) - (started_groups - dropped_groups))

    def may_start(self, *, learner_version: int, started_groups: int, dropped_groups: int = 0) -> bool:
        counts = {"started_groups": started_groups, "dropped_groups": dropped_groups}
        return self.capacity(learner_version=learner_version, **counts) > 0


def token_staleness(learner_version: int, token_versions: Tensor) -> Tensor:
    """``learner_version - token_versions`` elementwise; a token from a future version is an error."""
    if token_versions.dtype.is_floating_point:
        raise ValueError(f"token_versions: expected an integer tensor, got {token_versions.dtype}")
    staleness = learner_version - token_versions.long()
    if staleness.numel() and int(staleness.min()) < 0:
        raise ValueError(
            f"token_versions: version {int(token_versions.max())} is newer than learner_version {learner_version}"
        )
    return staleness


def sample_staleness(learner_version: int, token_versions: Tensor, response_lengths: Tensor) -> Tensor:
    """``LongTensor[B]``: ``learner_version - min(token versions)`` per sample, over packed ``token_versions [T]``.

    The oldest token decides: a weight update landing mid-generation does not make the earlier tokens fresher.
    A zero-length sample has staleness 0.
    """
    lengths = check_lengths(response_lengths)
    check_packed("token_versions", token_versions, lengths)
    per_token = token_staleness(learner_version, token_versions)
    out = torch.zeros(lengths.numel(), dtype=torch.long, device=per_token.device)
    return out.scatter_reduce(0, sample_index(lengths), per_token, reduce="amax", include_self=True)


class StaleAction(str, Enum):
    """What the buffer does with a sample past the bound: drop it, or give its prompt back to be regenerated."""

    EVICT = "evict"
    RELEASE = "release"


@dataclass(frozen=True)
class StalenessSplit:
    """Indices into the checked samples: ``fresh`` may be trained; ``stale`` get ``action``."""

    fresh: Tensor
    stale: Tensor
    action: StaleAction


def split_by_staleness(
    staleness: Tensor, max_staleness: int, action: StaleAction | str = StaleAction.EVICT
) -> StalenessSplit:
    """The consumption check: partition samples (``staleness: [B]``) by ``staleness <= max_staleness``."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness: must be >= 0, got {max_staleness}")
    action = StaleAction(action)
    too_old = staleness > max_staleness
    return StalenessSplit(fresh=(~too_old).nonzero().flatten(), stale=too_old.nonzero().flatten(), action=action)


def staleness_histogram(staleness: Tensor | Iterable[int]) -> dict[int, int]:
    """Counts per staleness value, sorted by value, e.g. ``{0: 120, 1: 8}`` (logged as ``staleness/<k>``)."""
    values = staleness.flatten().tolist() if isinstance(staleness, Tensor) else list(staleness)
    counts = Counter(int(v) for v in values)
    if counts and min(counts) < 0:
        raise ValueError(f"staleness: negative value {min(counts)}")
    return dict(sorted(counts.items()))
