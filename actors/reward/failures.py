"""What a reward worker makes of its reward function's failures: a few logged in full, the rest summarised, and a
breaker for a function that fails on everything.

A reward that raises on every sample would otherwise write one warning per sample (tens of thousands a minute)
while the run trains on nothing. The first `FIRST_LOGGED` failures are logged one by one with their traceback;
after that, one summary at most every `SUMMARY_EVERY_S` ("reward function X failed 5,312 times in the last
10 s; last error: ValueError: ..."). `limit` samples failing in a row, none scored in between, trip the breaker:
`tripped` then says why, naming the function and its last error, and the worker ends the run with it. A function
that fails now and then never trips it: one scored sample starts the count again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from policies.rewards import RewardOutcome

__all__ = ["FIRST_LOGGED", "SUMMARY_EVERY_S", "RewardFailures"]

FIRST_LOGGED = 5
SUMMARY_EVERY_S = 10.0


@dataclass(eq=False)
class RewardFailures:
    """Counts the outcomes of one reward function and logs its failures at a bounded rate."""

    log: Any
    function: str
    _: KW_ONLY
    limit: int
    first_logged: int = FIRST_LOGGED
    summary_every_s: float = SUMMARY_EVERY_S
    clock: Callable[[], float] = time.monotonic
    total: int = field(default=0, init=False)  # failures since start
    in_a_row: int = field(default=0, init=False)  # failures since the last scored sample
    last_error: str = field(default="", init=False)
    _unreported: int = field(default=0, init=False)  # failures neither logged one by one nor summarised yet
    _window_start: float = field(init=False)

    def __post_init__(self) -> None:
        if self.limit < 0:
            raise ValueError(f"reward_failure_limit: expected >= 0 (0 = never stop), got {self.limit}")
        self._window_start = self.clock()

    def record(self, sample_id: str, outcome: RewardOutcome) -> None:
        if outcome.status == "ok":
            self.in_a_row = 0
        else:
            self.total += 1
            self.in_a_row += 1
            self.last_error = outcome.reason
            if self.total <= self.first_logged:
                trace = {"exception": outcome.trace} if outcome.trace else {}  # the console prints it as is
                self.log.warning("reward failed", reward_function=self.function, sample=sample_id,
                                 reason=outcome.reason, **trace)
                if self.total == self.first_logged:
                    self.log.warning(f"further reward failures are summarised every {self.summary_every_s:g} s",
                                     reward_function=self.function)
            else:
                self._unreported += 1
        if self.clock() - self._window_start >= self.summary_every_s:
            self.flush()

    def flush(self) -> None:
        """Summarise the failures not logged yet (if any) and start a new window."""
        now = self.clock()
        if self._unreported:
            self.log.warning(f"reward function {self.function} failed {self._unreported:,} times in the last "
                             f"{now - self._window_start:.0f} s; last error: {self.last_error}",
                             reward_function=self.function, failed=self._unreported, failed_total=self.total,
                             failed_in_a_row=self.in_a_row)
        self._unreported = 0
        self._window_start = now

    @property
    def tripped(self) -> str | None:
        """Why the run should stop, once `limit` samples in a row failed (never with limit 0); else None."""
        if not self.limit or self.in_a_row < self.limit:
            return None
        return (f"reward function {self.function} failed on {self.in_a_row} samples in a row, none scored "
                f"(--reward-failure-limit {self.limit}); last error: {self.last_error}")
