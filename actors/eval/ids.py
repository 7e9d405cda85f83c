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


def take_eval_groups(queue: deque[PromptGroup], max_groups: int, weights_version: int | None,
                     max_samples: float = float("inf")) -> list[PromptGroup]:
    """Up to `max_groups` eval groups out of `queue`, in order, of versions the worker's weights can serve, and of
    at most `max_samples` samples together (the first is taken whatever its size).

    A group of version v goes only to a worker whose weights are v or newer (None: the learner pushes none, so
    any). An older engine may never get v's weights: the learner holds its pushes while v's round runs (an engine
    that joins mid-round gets nothing until then), and it would sit on the group until its deadline ran out.
    """
    servable = [g for g in queue if weights_version is None or (eval_version(g.group_id) or 0) <= weights_version]
    taken: list[PromptGroup] = []
    samples = 0
    for group in servable[:max_groups]:
        if taken and samples + group.n_samples > max_samples:
            break
        taken.append(group)
        samples += group.n_samples
    if taken:
        ids = {g.group_id for g in taken}
        remaining = [g for g in queue if g.group_id not in ids]
        queue.clear()
        queue.extend(remaining)
    return taken
