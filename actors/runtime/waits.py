"""What an actor is waiting for right now, and how much work it has finished: the hang detector's two inputs.

The controller cannot see inside a process, so each actor says, with every heartbeat, which cross-actor waits are
open ("learner waits for batch 41 from buffer") and a count of finished work that only grows. When no actor's
count moves for `--hang-timeout`, the open waits (and the actors that went silent) are the explanation the
controller prints. A wait is opened around the await itself (`with waits.on(...)`), or, for a state that spans
many awaits (a worker that keeps being told "nothing to lease"), opened and closed by key (`begin`/`end`), which
keeps the moment it started.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from bus.schema import WaitState

MAX_REPORTED = 16  # waits carried per heartbeat, oldest first: enough to explain, small enough to send every beat


@dataclass
class _Open:
    on: str
    what: str
    since: float


class Waits:
    """The open waits of one actor process, keyed so a repeated `begin` keeps the original start."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._open: dict[object, _Open] = {}
        self.progress = 0

    def made_progress(self, units: int = 1) -> None:
        """Count finished work (a group generated, scored or accepted, a batch served, a step trained)."""
        self.progress += units

    @contextlib.contextmanager
    def on(self, on: str, what: str) -> Iterator[None]:
        """Open a wait for the duration of the block (nested or concurrent blocks each count)."""
        key = object()
        self._open[key] = _Open(on, what, self._clock())
        try:
            yield
        finally:
            del self._open[key]

    def begin(self, key: object, on: str, what: str) -> None:
        """Open a wait that lasts until `end(key)`; beginning it again updates the words, not the start."""
        current = self._open.get(key)
        if current is None:
            self._open[key] = _Open(on, what, self._clock())
        else:
            current.on, current.what = on, what

    def end(self, key: object) -> None:
        self._open.pop(key, None)

    def snapshot(self) -> list[WaitState]:
        """The open waits, oldest first, at most MAX_REPORTED of them."""
        now = self._clock()
        ordered = sorted(self._open.values(), key=lambda wait: wait.since)[:MAX_REPORTED]
        return [WaitState(on=wait.on, what=wait.what, waited_s=round(now - wait.since, 3)) for wait in ordered]
