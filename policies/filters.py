"""Sample filters (dynamic sampling, ``--dynamic-sampling-filter-path``).

A filter judges one complete prompt group and says keep or drop, with a reason that becomes a metric
(``filter/dropped/<reason>``). Signature, for built-ins and user plugins alike::

    fn(group: FilterGroup) -> bool | FilterVerdict

Built-ins: ``nonzero_std`` (DAPO's dynamic sampling: a group whose rewards are all equal has zero advantage under
group normalisation, so it only dilutes the batch) and ``no_reward_errors`` (drop a group if any sample's reward
function failed, rather than train on a made-up reward).

There is no over-sampling step (slime's ``--over-sampling-batch-size``: when kept samples fall short, launch another
round of that many prompts). slime needs it because it generates one batch at a time; here the buffer's admission
is continuous and per group: a dropped group gives its slot back to the budget at once
(``AdmissionController.capacity``), and rollout workers lease as they have room, so a batch refills one group at
a time without a batch-sized round that would start groups past the staleness budget.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from policies.registry import register_filter, resolve_filter

__all__ = ["FilterGroup", "FilterVerdict", "apply_filters", "no_reward_errors", "nonzero_std"]


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
