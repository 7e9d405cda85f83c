"""Staleness control (``--max-staleness``): admission at the buffer, a re-check at consumption, a histogram.

Definitions (DESIGN.md): a policy version is the number of optimizer steps applied; every generated token carries
the version of the weights that produced it; a sample's staleness when consumed is
``learner_version - min(token versions)``, or more generally the largest distance ``|learner_version - t|`` over its
token versions ``t``, which also covers tokens newer than a learner that restarted from a checkpoint
(:func:`token_staleness` says why).

Admission. Batch ``k`` (``B`` groups) is trained while the learner is at version ``k``. If groups are accepted
in the order they start, the group that starts ``n``-th (0-based) lands in batch ``n // B``; starting it while the
learner is at ``v`` gives staleness ``n // B - v``. Keeping ``n < (v + eta + 1) * B`` therefore bounds it by
``eta`` by construction, and ``eta = 0`` is exactly synchronous training: at version ``v`` the first ``(v + 1) * B``
groups may have started, i.e. precisely batch ``v``, and nothing of batch ``v + 1`` starts until the learner has
stepped. Groups a filter dropped never occupy a batch slot, so they are given back to the budget.

When groups finish out of start order, a later group can take an earlier group's slot and push it one batch
later; the consumption check is the backstop that keeps the bound hard either way: the buffer measures each pooled
group with :func:`staleness_of_range` at the version its batch trains at and regenerates the ones past the bound
(:func:`split_by_staleness` is the same rule per sample, for a trainer that holds samples itself).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import ArrayLike

if TYPE_CHECKING:  # the buffer measures staleness without torch, and starts ~2 s sooner for not importing it
    from torch import Tensor

__all__ = [
    "AdmissionController",
    "StaleAction",
    "StalenessSplit",
    "sample_staleness",
    "split_by_staleness",
    "staleness_histogram",
    "staleness_of_range",
    "staleness_of_samples",
    "token_staleness",
    "version_range",
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
    """Per token: how many optimizer steps separate the weights that produced it from the learner's, ``|v - t|``.

    Normally every token is older than the learner (``t <= v``) and this is ``v - t``. A token *newer* than the
    learner happens for real: a learner restarted from its last checkpoint (``Learner._restore`` loads the version
    the checkpoint was taken at) while the engines still serve, and the buffer's pool still holds samples from, the
    newer weights it published before it died. Those weights belong to the lineage the restart abandoned, and they
    are ``t - v`` optimizer steps away from the weights the learner will now compute its importance ratios with:
    exactly as off-policy as weights ``t - v`` steps older. So the distance counts, in both directions. Clamping it
    to 0 would pass samples from arbitrarily distant weights through the bound as fresh; raising would crash the
    buffer on a restart the failure model promises to survive.
    """
    if token_versions.dtype.is_floating_point:
        raise ValueError(f"token_versions: expected an integer tensor, got {token_versions.dtype}")
    return (learner_version - token_versions.long()).abs()


def sample_staleness(learner_version: int, token_versions: Tensor, response_lengths: Tensor) -> Tensor:
    """``LongTensor[B]``: the largest :func:`token_staleness` of each sample, over packed ``token_versions [T]``.

    The farthest token decides, which for ordinary samples is ``learner_version - min(token versions)``: a weight
    update landing mid-generation does not make the earlier tokens fresher. A zero-length sample has staleness 0.
    This is the definition of a sample's staleness. The buffer measures it from each sample's or group's version
    range (:func:`version_range`, :func:`staleness_of_range`), which gives the same number because ``|v - t|`` is
    largest at an end of the range (checked against this function in the tests), without torch.
    """
    import torch

    from policies.packing import check_lengths, check_packed, sample_index

    lengths = check_lengths(response_lengths)
    check_packed("token_versions", token_versions, lengths)
    per_token = token_staleness(learner_version, token_versions)
    out = torch.zeros(lengths.numel(), dtype=torch.long, device=per_token.device)
    return out.scatter_reduce(0, sample_index(lengths), per_token, reduce="amax", include_self=True)


def staleness_of_samples(learner_version: int, token_versions: Sequence[ArrayLike | None]) -> list[int]:
    """:func:`sample_staleness` for samples that hold their own ``token_versions`` (None: no tokens, staleness 0)."""
    return [staleness_of_range(learner_version, version_range([versions])) for versions in token_versions]


def version_range(token_versions: Iterable[ArrayLike | None]) -> tuple[int, int] | None:
    """The oldest and newest token version over some samples' ``token_versions`` (None when there is no token).

    All a staleness needs (:func:`staleness_of_range`), so the buffer computes it once per group and then measures
    the group against any version in constant time, instead of going over its tokens on every batch request.
    """
    oldest: int | None = None
    newest: int | None = None
    for versions in token_versions:
        array = np.asarray([] if versions is None else versions)
        if array.size == 0:
            continue
        if not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"token_versions: expected integers, got {array.dtype}")
        low, high = int(array.min()), int(array.max())
        oldest = low if oldest is None else min(oldest, low)
        newest = high if newest is None else max(newest, high)
    return None if oldest is None or newest is None else (oldest, newest)


def staleness_of_range(learner_version: int, versions: tuple[int, int] | None) -> int:
    """:func:`token_staleness` of the farthest token whose version lies in ``versions`` (oldest, newest): the
    distance ``|v - t|`` is largest at one end of the range. No tokens: 0."""
    if versions is None:
        return 0
    oldest, newest = versions
    return max(abs(learner_version - oldest), abs(learner_version - newest))


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
    values = staleness.flatten().tolist() if hasattr(staleness, "flatten") else list(staleness)
    counts = Counter(int(v) for v in values)
    if counts and min(counts) < 0:
        raise ValueError(f"staleness: negative value {min(counts)}")
    return dict(sorted(counts.items()))
