"""slime's ``--buffer-filter-path``: a plugin that picks which finished groups form the next training batch.

slime keeps finished groups in a list and, for each rollout, asks ``fn(args, rollout_id, buffer, num_samples)``
for up to ``num_samples`` of them (its default, ``pop_first``, takes the oldest). Here the list is the buffer's
pool of scored groups in admission order, ``rollout_id`` is the id of the batch being formed and ``num_samples``
the groups per batch. The groups the plugin returns are matched back to the pool by the identity of the samples
it was handed (or, for a plugin that copies them, by the group id stashed in each sample's metadata); the buffer
fills any shortfall with the oldest groups and falls back to oldest-first on an answer it cannot use
(``BufferCore`` counts and reports those). The plugin gets fresh lists each call, so removing what it picks from
``buffer``, as slime's filters do, changes nothing here.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from actors.config import RunConfig
from actors.extensions.points import BatchSelector, SelectionError
from actors.slime_compat.args import build_args
from actors.slime_compat.data_source import pop_first
from actors.slime_compat.sample import Sample, from_wire
from bus.schema import ScoredGroup
from policies.plugins import load_callable

__all__ = ["GROUP_ID_KEY", "adapt_buffer_filter", "load_buffer_filter", "pop_first"]

GROUP_ID_KEY = "buffer_group_id"  # in each offered sample's metadata: the pool group it belongs to
SLIME_DEFAULT = "slime.rollout.data_source.pop_first"  # slime's default spelled out: our oldest-first batches


def load_buffer_filter(config: RunConfig) -> BatchSelector | None:
    """The configured ``--buffer-filter-path`` as the buffer core's batch selector, or None for oldest-first."""
    path = config.buffer.buffer_filter_path
    if not path or path == SLIME_DEFAULT:
        return None
    fn = load_callable(path, what="--buffer-filter-path")
    try:
        inspect.signature(fn).bind(None, 0, [], 1)
    except TypeError as error:
        raise TypeError(f"--buffer-filter-path {path!r}: expected slime's signature "
                        f"fn(args, rollout_id, buffer, num_samples) ({error})") from None
    except ValueError:
        pass  # a builtin without a signature: trust it
    return adapt_buffer_filter(fn, build_args(config), path)


def adapt_buffer_filter(fn: Callable[..., Any], args: Any, path: str) -> BatchSelector:
    """Our batch selector (groups, count, batch id) -> group ids around a slime buffer filter."""

    def select(groups: list[ScoredGroup], count: int, batch_id: int) -> list[str]:
        offered = [[_offered(sample, group.group_id) for sample in group.samples] for group in groups]
        owners = {id(sample): (sample, group.group_id) for group, samples in zip(groups, offered, strict=True)
                  for sample in samples}
        output = fn(args, batch_id, [list(samples) for samples in offered], count)
        if not isinstance(output, list):
            raise SelectionError("not_a_list", f"returned {type(output).__name__}; expected list[list[Sample]]")
        known = {group.group_id for group in groups}
        return [_group_of(item, position, owners, known) for position, item in enumerate(output)]

    select.__name__ = f"--buffer-filter-path {path}"
    return select


def _offered(wire: Any, group_id: str) -> Sample:
    sample = from_wire(wire)
    sample.metadata[GROUP_ID_KEY] = group_id
    return sample


def _group_of(item: Any, position: int, owners: dict[int, tuple[Sample, str]], known: set[str]) -> str:
    """The pool group a returned group came from: every sample must be one that group's, as offered or a copy."""
    if not isinstance(item, list | tuple) or not item or not all(isinstance(s, Sample) for s in item):
        raise SelectionError("not_a_list", f"item {position} is {_describe(item)}; expected a non-empty list of "
                             "Samples (one group)")
    found = set()
    for sample in item:
        entry = owners.get(id(sample))
        if entry is not None and entry[0] is sample:
            found.add(entry[1])
        elif sample.metadata.get(GROUP_ID_KEY) in known:
            found.add(sample.metadata[GROUP_ID_KEY])
        else:
            raise SelectionError("not_offered", f"item {position} holds a sample that was not offered")
    if len(found) > 1:
        raise SelectionError("not_offered", f"item {position} mixes samples of groups {sorted(found)}")
    return found.pop()


def _describe(item: Any) -> str:
    if not isinstance(item, list | tuple):
        return type(item).__name__
    stray = next((s for s in item if not isinstance(s, Sample)), None)
    return "an empty list" if stray is None else f"a list holding {type(stray).__name__}"
