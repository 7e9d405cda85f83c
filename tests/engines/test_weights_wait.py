"""Waiting on a collective in slices: a slice that times out as the collective completes is not a failure.

The race (gloo's wait_for times out, then the collective completes before we look at it) cannot be timed with a
real group, so the collective here is a stand-in with gloo's Work semantics: `wait(timeout)` raises "Operation
timed out!" while the work is pending, `wait()` returns or raises the work's own error once it completed.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from engines.weights.group import wait_work

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
