"""Whether a batch selector's answer (slime's --buffer-filter-path, through actors.slime_compat.buffer_filter) can be
used as it is: a plugin's mistake is counted under a reason and the batch is taken oldest-first instead."""

from __future__ import annotations

from collections import Counter
from typing import Any

from actors.extensions.points import SelectionError
from bus.schema import ScoredGroup


def checked_selection(picked: Any, pool: dict[str, ScoredGroup], count: int) -> list[str]:
    if not isinstance(picked, list) or not all(isinstance(gid, str) for gid in picked):
        raise SelectionError("not_a_list", f"returned {type(picked).__name__}; expected a list of group ids")
    if len(picked) > count:
        raise SelectionError("too_many", f"returned {len(picked)} groups; at most {count} were asked for")
    repeated = sorted(gid for gid, seen in Counter(picked).items() if seen > 1)
    if repeated:
        raise SelectionError("duplicate", f"returned group(s) {repeated} more than once")
    unknown = [gid for gid in picked if gid not in pool]
    if unknown:
        raise SelectionError("not_offered", f"returned group(s) {unknown} that were not offered")
    return picked
