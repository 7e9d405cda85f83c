"""How long to wait before starting again what crashed: the launcher restarting an actor and a node's learner rank
keeper starting a fresh rank set follow one rule (`--restart-backoff`, doubling while the ends come in a row), so a
crash loop backs off the same way wherever it happens."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 5
    window_s: float = 300.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0

    def backoff(self, ends_in_a_row: int) -> float:
        """The wait before the next start: the initial backoff after one end, doubling for each further end in a row,
        up to `backoff_max_s`."""
        return min(self.backoff_max_s, self.backoff_initial_s * 2 ** max(0, ends_in_a_row - 1))
