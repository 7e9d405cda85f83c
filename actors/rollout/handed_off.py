"""Which reward worker holds each group this rollout worker generated, until the buffer would have expired it.

A group handed to a reward worker is no longer under any lease this worker renews, so if that reward worker dies
the buffer only finds out when the lease times out. Remembering the hand-offs lets the rollout worker name the
lost groups the moment the roster reports the death.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


class HandedOff:
    """(lease id, group id) per reward worker, forgotten after `keep_s` (by then the lease has expired anyway)."""

    def __init__(self, keep_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.keep_s = keep_s
        self._clock = clock
        self._by_reward: dict[str, OrderedDict[str, tuple[str, float]]] = {}

    def note(self, reward_worker: str, lease_id: str, group_id: str) -> None:
        held = self._by_reward.setdefault(reward_worker, OrderedDict())
        held[group_id] = (lease_id, self._clock())
        held.move_to_end(group_id)
        horizon = self._clock() - self.keep_s
        while held and next(iter(held.values()))[1] < horizon:
            held.popitem(last=False)

    def lost_with(self, reward_worker: str) -> list[tuple[str, str]]:
        """Everything handed to `reward_worker` within `keep_s`, as (lease id, group id); forgotten here."""
        held = self._by_reward.pop(reward_worker, OrderedDict())
        horizon = self._clock() - self.keep_s
        return [(lease_id, group_id) for group_id, (lease_id, at) in held.items() if at >= horizon]
