"""A breaker for a user's function that fails on everything, with its failures logged at a bounded rate.

A reward function, or a generate function, that raises on every sample would otherwise write one warning per
sample (tens of thousands a minute) while the run trains on nothing, and never end: each failed group is dropped
and the next prompt fails the same way. The first `FIRST_LOGGED` failures are logged one by one with their traceback;
after that, one summary at most every `SUMMARY_EVERY_S` ("reward function X failed 5,312 times in the last 10 s;
last error: ValueError: ..."). `limit` samples failing in a row, none done in between, trip the breaker: `tripped`
then says why, naming the function, the count, the setting and the last error, and the actor ends the run with it.
A function that fails now and then never trips it: one sample done starts the count again.

One breaker serves each such limit (`--reward-failure-limit` in the reward worker, `--generate-failure-limit` in the
rollout worker); what differs is only their words, given at construction.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

__all__ = ["FIRST_LOGGED", "SUMMARY_EVERY_S", "FailureBreaker"]

FIRST_LOGGED = 5
SUMMARY_EVERY_S = 10.0


@dataclass(eq=False)
class FailureBreaker:
    """Counts one function's failures and successes, sample by sample, and logs the failures at a bounded rate.

    `subject` names the function in messages ("reward function pkg.rm:score"); `setting` is the limit's setting
    (`reward_failure_limit`: its flag is `--reward-failure-limit`); `what` names a failure's log event ("reward" ->
    "reward failed"); `done` says what a sample that did not fail was ("scored"); `fields` go on every log record
    (`{"reward_function": "pkg.rm:score"}`), so a log reader filters by them."""

    log: Any
    subject: str
    _: KW_ONLY
    limit: int
    setting: str
    what: str
    done: str
    fields: dict[str, str] = field(default_factory=dict)
    first_logged: int = FIRST_LOGGED
    summary_every_s: float = SUMMARY_EVERY_S
    clock: Callable[[], float] = time.monotonic
    total: int = field(default=0, init=False)  # failed samples since start
    in_a_row: int = field(default=0, init=False)  # failed samples since the last one done
    last_error: str = field(default="", init=False)
    _logged: int = field(default=0, init=False)  # failures logged one by one
    _unreported: int = field(default=0, init=False)  # failed samples neither logged one by one nor summarised yet
    _window_start: float = field(init=False)

    def __post_init__(self) -> None:
        if self.limit < 0:
            raise ValueError(f"{self.setting}: expected >= 0 (0 = never stop), got {self.limit}")
        self._window_start = self.clock()

    @property
    def flag(self) -> str:
        return "--" + self.setting.replace("_", "-")

    def succeeded(self) -> None:
        """A sample was done: the count in a row starts again."""
        self.in_a_row = 0
        self._maybe_flush()

    def failed(self, item: str, reason: str, trace: str | None = None, *, samples: int = 1) -> None:
        """`samples` samples of `item` (a sample, or a group that failed as a whole) failed with `reason`."""
        self.total += samples
        self.in_a_row += samples
        self.last_error = reason
        if self._logged < self.first_logged:
            self._logged += 1
            extra = {"exception": trace} if trace else {}  # the console prints it as is
            self.log.warning(f"{self.what} failed", **self.fields, sample=item, reason=reason, **extra)
            if self._logged == self.first_logged:
                self.log.warning(f"further {self.what} failures are summarised every {self.summary_every_s:g} s",
                                 **self.fields)
        else:
            self._unreported += samples
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        if self.clock() - self._window_start >= self.summary_every_s:
            self.flush()

    def flush(self) -> None:
        """Summarise the failures not logged yet (if any) and start a new window."""
        now = self.clock()
        if self._unreported:
            self.log.warning(f"{self.subject} failed {self._unreported:,} times in the last "
                             f"{now - self._window_start:.0f} s; last error: {self.last_error}",
                             **self.fields, failed=self._unreported, failed_total=self.total,
                             failed_in_a_row=self.in_a_row)
        self._unreported = 0
        self._window_start = now

    @property
    def tripped(self) -> str | None:
        """Why the run should stop, once `limit` samples in a row failed (never with limit 0); else None."""
        if not self.limit or self.in_a_row < self.limit:
            return None
        return (f"{self.subject} failed on {self.in_a_row} samples in a row, none {self.done} "
                f"({self.flag} {self.limit}); last error: {self.last_error}")
