"""Waiting on a collective in slices: a slice that times out as the collective completes is not a failure; and
polling the store for a key sees it soon after it appears, however long the wait.

The race (gloo's wait_for times out, then the collective completes before we look at it) cannot be timed with a
real group, so the collective here is a stand-in with gloo's Work semantics: `wait(timeout)` raises "Operation
timed out!" while the work is pending, `wait()` returns or raises the work's own error once it completed.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from engines.weights import interruptible_store
from engines.weights.group import wait_work
from engines.weights.interruptible_store import POLL_S, poll_keys

pytestmark = pytest.mark.unit


class CompletesDuringTheSlice:
    """Pending when a slice's wait gives up, completed by the time the caller looks (with `error`, if any)."""

    def __init__(self, error: str | None = None) -> None:
        self.error, self.completed, self.waits = error, False, 0

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.waits += 1
        if not self.completed:
            self.completed = True  # completes right after this slice timed out
            raise RuntimeError("peer died" if self.error else "Operation timed out!")
        if self.error:
            raise RuntimeError(self.error)
        return True

    def is_completed(self) -> bool:
        return self.completed


def test_a_collective_that_completes_as_its_slice_times_out_has_completed() -> None:
    work = CompletesDuringTheSlice()
    assert wait_work(work, stop=lambda: False) is True  # type: ignore[arg-type]


def test_a_collective_that_failed_raises_its_own_error() -> None:
    with pytest.raises(RuntimeError, match="peer died"):
        wait_work(CompletesDuringTheSlice(error="peer died"), stop=lambda: False)  # type: ignore[arg-type]


def test_a_pending_collective_is_left_as_soon_as_the_caller_stops() -> None:
    class Pending(CompletesDuringTheSlice):
        def wait(self, timeout: timedelta | None = None) -> bool:
            raise RuntimeError("Operation timed out!")

    assert wait_work(Pending(), stop=lambda: True) is False  # type: ignore[arg-type]


class KeyAppearsAt:
    """A store whose keys appear at virtual time `at`, on a virtual clock that `sleep` advances: when `poll_keys`
    sees a key is a matter of its pauses, not of this machine's speed."""

    def __init__(self, at: float) -> None:
        self.at, self.now, self.looks = at, 0.0, 0

    def check(self, keys: list[str]) -> bool:
        self.looks += 1
        return self.now >= self.at

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.mark.parametrize("appears_at", [0.005, 0.2, 1.0, 30.0])
def test_a_polled_key_is_seen_within_a_twentieth_of_the_wait_and_a_long_wait_looks_seldom(
        monkeypatch: pytest.MonkeyPatch, appears_at: float) -> None:
    """A weight push's acknowledgement comes ~0.2 s after the sender starts waiting: seen up to 50 ms late, it
    made every push a quarter slower."""
    store = KeyAppearsAt(appears_at)
    monkeypatch.setattr(interruptible_store.time, "monotonic", lambda: store.now)
    monkeypatch.setattr(interruptible_store.time, "sleep", store.sleep)
    assert poll_keys(store, ["ack/1"], timeout_s=60.0, stop=lambda: False)  # type: ignore[arg-type]
    assert store.now - appears_at <= max(0.001, appears_at / 20) + 1e-9
    assert store.looks <= 20 * 10 + appears_at / POLL_S  # ~20 looks per e-fold of the wait, then one per POLL_S
