"""Keeping the engines on an evaluated version's weights until its evaluation round has reported.

In a fully-async run the learner pushes new weights after every step, so an eval round tagged v would otherwise be
generated partly by v+1, v+2...: its accuracy would not be v's. After pushing a version that gets a round, the
learner holds further pushes until the buffer says the round is done (`Batch.eval_done_through`). Training goes on
meanwhile as far as the staleness bound allows; a round that does not finish in time is let go with a warning.
A due version trained during a hold is never pushed; the buffer then gives its round to the next version pushed
(`round_due`), and the hold pins that one.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from actors.config import RunConfig
from actors.eval.rounds import round_due


class EvalHold:
    def __init__(self, config: RunConfig, *, counters: Counter[str], log: Any, timeout_s: float) -> None:
        self.config = config
        self.counters = counters
        self.log = log
        self.timeout_s = timeout_s
        self.pinned: int | None = None  # the version whose round the engines are generating
        self.done_through = -1  # as last reported by the buffer
        self.last_published: int | None = None
        self._deadline = 0.0

    def published(self, version: int) -> None:
        """The engines now serve `version`: hold them there if it gets a round that has not reported yet."""
        due = round_due(self.config, self.last_published, version)
        self.last_published = version if self.last_published is None else max(self.last_published, version)
        if self.done_through < version and due:
            self.pinned = version
            self._deadline = time.monotonic() + self.timeout_s

    def reported(self, done_through: int) -> None:
        self.done_through = max(self.done_through, done_through)

    def holds(self) -> bool:
        """Whether a push now would move the engines off a version whose round is still being generated."""
        if self.pinned is None:
            return False
        if self.done_through >= self.pinned:
            self.pinned = None
            return False
        if time.monotonic() > self._deadline:
            self.counters["eval.hold_timeouts"] += 1
            self.log.warning("eval round did not report in time; pushing newer weights anyway (its remaining "
                             "samples count as off-version)", version=self.pinned, timeout_s=self.timeout_s)
            self.pinned = None
            return False
        self.counters["eval.held_pushes"] += 1
        return True
