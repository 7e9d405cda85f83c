"""A buffer filter in slime's style: the groups whose rewards disagree most train first.

A group whose samples all earn the same reward gives a group-normalised advantage of zero everywhere, so it
teaches nothing; the wider the spread, the stronger the signal. This filter hands the next batch the
``num_samples`` groups with the highest reward variance (ties: the older group first) and removes them from
``buffer``, as slime's ``pop_first`` does; the rest wait for a later batch. With fewer groups than asked for it
returns what there is. Run with ``--buffer-filter-path examples.slime_style.buffer_filter:highest_variance_first``.
"""

from __future__ import annotations

from statistics import pvariance
from typing import Any

from actors.slime_compat import Sample, pop_first


def reward_variance(args: Any, group: list[Sample]) -> float:
    return pvariance([float(sample.get_reward_value(args)) for sample in group]) if group else 0.0


def highest_variance_first(args: Any, rollout_id: int | None, buffer: list[list[Sample]],
                           num_samples: int) -> list[list[Sample]]:
    order = sorted(range(len(buffer)), key=lambda i: -reward_variance(args, buffer[i]))  # stable: older wins ties
    picked = [buffer[i] for i in order[:num_samples]]
    chosen = set(order[:num_samples])
    buffer[:] = [group for i, group in enumerate(buffer) if i not in chosen]
    return picked


def oldest_first(args: Any, rollout_id: int | None, buffer: list[list[Sample]],
                 num_samples: int) -> list[list[Sample]]:
    """slime's default, for comparison (``--buffer-filter-path examples.slime_style.buffer_filter:oldest_first``)."""
    return pop_first(args, rollout_id, buffer, num_samples)
