"""Groups other roles own (`PromptGroup.owner`: an eval round's), queued at the buffer to lease out first."""

from __future__ import annotations

from collections import deque

from bus.schema import PromptGroup


def take_guest_groups(queue: deque[PromptGroup], max_groups: int, weights_version: int | None,
                      max_samples: float = float("inf")) -> list[PromptGroup]:
    """Up to `max_groups` groups out of `queue`, in order, that the worker's weights can serve, and of at most
    `max_samples` samples together (the first is taken whatever its size).

    A group for weights v (`PromptGroup.weights_version`) goes only to a worker whose weights are v or newer (None:
    the learner pushes none, so any). An older engine may never get v's weights: the learner holds its pushes while
    v is pinned (an engine that joins meanwhile gets nothing until then), and it would sit on the group until its
    deadline ran out.
    """
    servable = [g for g in queue if weights_version is None or (g.weights_version or 0) <= weights_version]
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
