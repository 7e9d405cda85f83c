"""Sample filters (dynamic sampling, ``--dynamic-sampling-filter-path``) and over-sampling bookkeeping.

A filter judges one complete prompt group and says keep or drop, with a reason that becomes a metric
(``filter/dropped/<reason>``). Signature, for built-ins and user plugins alike::

    fn(group: FilterGroup) -> bool | FilterVerdict

Built-ins: ``nonzero_std`` (DAPO's dynamic sampling: a group whose rewards are all equal has zero advantage under
group normalisation, so it only dilutes the batch) and ``no_reward_errors`` (drop a group if any sample's reward
function failed, rather than train on a made-up reward).

:class:`OverSampler` does the bookkeeping the buffer needs when filters drop groups: how many more groups to
request so a batch still fills, and drop counts by reason.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from policies.registry import register_filter, resolve_filter

__all__ = ["FilterGroup", "FilterVerdict", "OverSampler", "apply_filters", "no_reward_errors", "nonzero_std"]


@dataclass(frozen=True)
class FilterGroup:
    """One prompt's finished samples. ``rewards[i]`` is None when sample i's reward failed (status "error").

    ``samples`` are the actor's own sample objects, passed through opaquely for user filters that need more.
    """

    rewards: Sequence[float | None]
    statuses: Sequence[str] = ()
    samples: Sequence[Any] = ()
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class FilterVerdict:
    keep: bool
    reason: str = ""


@register_filter("nonzero_std")
def nonzero_std(group: FilterGroup) -> FilterVerdict:
    """Keep a group only if its rewards are not all equal (a singleton group has zero spread: dropped)."""
    rewards = [r for r in group.rewards if r is not None]
    if len(rewards) < 2 or max(rewards) - min(rewards) == 0:
        return FilterVerdict(keep=False, reason="zero_std")
    return FilterVerdict(keep=True)


@register_filter("no_reward_errors")
def no_reward_errors(group: FilterGroup) -> FilterVerdict:
    failed = any(r is None for r in group.rewards) or any(s == "error" for s in group.statuses)
    return FilterVerdict(keep=False, reason="reward_error") if failed else FilterVerdict(keep=True)


def apply_filters(filters: Sequence[str | Callable[[FilterGroup], Any]], group: FilterGroup) -> FilterVerdict:
    """Run filters in order; the first drop wins. A filter that raises drops the group with reason
    ``filter_error:<name>`` instead of crashing the buffer; a non-bool/non-verdict result is an error verdict too.
    """
    for spec in filters:
        fn = resolve_filter(spec) if isinstance(spec, str) else spec
        name = spec if isinstance(spec, str) else getattr(spec, "__name__", type(spec).__name__)
        try:
            result = fn(group)
        except Exception:  # a user filter bug costs one group, not the run
            return FilterVerdict(keep=False, reason=f"filter_error:{name}")
        if isinstance(result, FilterVerdict):
            verdict = result
        elif isinstance(result, bool):
            verdict = FilterVerdict(keep=result, reason="" if result else name)
        else:
            return FilterVerdict(keep=False, reason=f"filter_error:{name}")
        if not verdict.keep:
            return FilterVerdict(keep=False, reason=verdict.reason or name)
    return FilterVerdict(keep=True)


@dataclass
class OverSampler:
    """Over-sampling bookkeeping for one batch: ``target_groups`` must be kept; dropped groups are replaced.

    ``over_sampling_batch_size`` (slime's flag) is the granularity of extra requests: when kept plus in-flight
    groups fall short of the target, request the shortfall rounded up to a multiple of it (None: exactly the
    shortfall). Counters are plain ints so the buffer can persist them in its durable log.
    """

    target_groups: int
    over_sampling_batch_size: int | None = None
    kept: int = 0
    dropped: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        if self.target_groups < 1:
            raise ValueError(f"target_groups: must be >= 1, got {self.target_groups}")
        if self.over_sampling_batch_size is not None and self.over_sampling_batch_size < 1:
            raise ValueError(f"over_sampling_batch_size: must be >= 1, got {self.over_sampling_batch_size}")

    def record(self, verdict: FilterVerdict) -> None:
        if verdict.keep:
            self.kept += 1
        else:
            self.dropped[verdict.reason or "unspecified"] += 1

    @property
    def done(self) -> bool:
        return self.kept >= self.target_groups

    def groups_to_request(self, in_flight: int) -> int:
        """How many more groups to lease now, given ``in_flight`` groups not yet judged."""
        shortfall = self.target_groups - self.kept - in_flight
        if shortfall <= 0:
            return 0
        step = self.over_sampling_batch_size
        return shortfall if step is None else step * math.ceil(shortfall / step)

    def metrics(self) -> dict[str, float]:
        total = self.kept + sum(self.dropped.values())
        out = {"filter/kept": float(self.kept), "filter/judged": float(total)}
        out.update({f"filter/dropped/{reason}": float(n) for reason, n in sorted(self.dropped.items())})
        out["filter/keep_rate"] = self.kept / total if total else 1.0
        return out

    def next_batch(self) -> None:
        """Reset the counters for the next batch (the caller logs :meth:`metrics` first)."""
        self.kept = 0
        self.dropped = Counter()
