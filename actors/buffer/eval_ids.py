"""An eval group's id names the version it evaluates: `eval:SET:VERSION:INDEX`.

The round that makes the groups, the buffer that leases them and the rollout worker that generates them all read
the version from the id, so the format lives here once.
"""

from __future__ import annotations

from collections import deque

from bus.schema import PromptGroup


def eval_group_id(set_name: str, version: int, data_index: int) -> str:
    return f"eval:{set_name}:{version}:{data_index}"


def eval_version(group_id: str) -> int | None:
    """The version an eval group evaluates (None for any other id)."""
    parts = group_id.split(":")
    if len(parts) == 4 and parts[0] == "eval" and parts[2].isdigit():
        return int(parts[2])
    return None


def take_eval_groups(queue: deque[PromptGroup], max_groups: int, weights_version: int | None) -> list[PromptGroup]:
    """Up to `max_groups` eval groups out of `queue`, in order, of versions the worker's weights can serve.

    A group of version v goes only to a worker whose weights are v or newer (None: the learner pushes none, so
    any). An older engine may never get v's weights: the learner holds its pushes while v's round runs (an engine
    that joins mid-round gets nothing until then), and it would sit on the group until its deadline ran out.
    """
    taken = [g for g in queue if weights_version is None or (eval_version(g.group_id) or 0) <= weights_version]
    taken = taken[:max_groups]
    if taken:
        ids = {g.group_id for g in taken}
        remaining = [g for g in queue if g.group_id not in ids]
        queue.clear()
        queue.extend(remaining)
    return taken
