"""A store view whose blocking waits end as soon as the generation they serve is given up.

Gloo builds a process group by waiting on the store for every member's address, inside a C++ constructor no
other thread can interrupt. A member that died between joining and constructing left every other member in that
wait until the group's timeout (the weight-transfer timeout, 30 s by default): a killed rollout worker cost the
run that long whenever its death fell into a group formation, although the learner heard of the death within a
second. Waits through this view poll the store in short slices and raise `GroupGivenUp` once `stop()` names a
reason, which gloo passes up as the constructor's error.

Only for building a gloo group, whose store traffic is that rendezvous: a poll sees a key a little late (~5% of
the time waited, at most POLL_S), a cost a transfer's per-bucket waits would pay on every bucket. `poll_keys`
serves the transfer's waits that must end early (readiness, acknowledgements), which are one per push.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

POLL_S = 0.05  # the longest pause between two looks at the store (or at a pending collective) while waiting
MIN_PAUSE_S = 0.001


def poll_keys(store: dist.Store, keys: list[str], timeout_s: float, stop: Callable[[], bool]) -> bool:
    """Whether all `keys` appeared within `timeout_s`, the store looked at most POLL_S apart; False as soon as
    `stop()` is true too (the caller asks `stop()` again to tell the two apart).

    The pause between two looks grows with the time waited so far (a twentieth of it, from 1 ms up to POLL_S):
    a key is seen at most ~5% of the wait late. Doubling the pause instead saw the acknowledgement of a 0.2 s
    weight push up to 50 ms late, a quarter of the push, on every push."""
    started = time.monotonic()
    deadline = started + timeout_s
    while not store.check(keys):
        now = time.monotonic()
        if now >= deadline or stop():
            return False
        time.sleep(min(max(MIN_PAUSE_S, (now - started) / 20), POLL_S, deadline - now))
    return True


class GroupGivenUp(RuntimeError):
    """A wait ended because the generation was given up, not because its keys came or its deadline passed."""


class InterruptibleStore(dist.Store):
    """Delegates to `inner`; `wait` and `get` poll it and stop when `stop()` returns a reason (None: go on)."""

    def __init__(self, inner: dist.Store, stop: Callable[[], str | None]) -> None:
        super().__init__()
        self._inner, self._stop = inner, stop
        self._timeout = inner.timeout

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Polls with `check`: the store's own wait, cut into slices, would have torch log a warning at every slice
        that timed out."""
        budget = (timeout or self._timeout).total_seconds()
        why: list[str] = []

        def given_up() -> bool:
            reason = self._stop()
            if reason is not None:
                why.append(reason)
            return reason is not None

        if poll_keys(self._inner, keys, budget, given_up):
            return
        if why:
            raise GroupGivenUp(f"gave up waiting for {keys}: {why[0]}")
        raise dist.DistStoreError(f"wait timeout after {budget * 1000:.0f}ms, keys: {keys}")

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self._inner.get(key)

    def set(self, key: str, value: bytes | str) -> None:
        self._inner.set(key, value)

    def add(self, key: str, amount: int) -> int:
        return self._inner.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self._inner.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout
