"""What a reward worker makes of its reward function's failures: the run's failure breaker
(`actors.runtime.failures`) in the reward's words, fed one `RewardOutcome` per sample.

A failing sample is logged as "reward failed" (the first few), summarised as "reward function X failed N times in the
last 10 s", and `--reward-failure-limit` samples in a row, none scored, end the run with "reward function X failed on N
samples in a row, none scored (--reward-failure-limit N); last error: ...".
"""

from __future__ import annotations

from typing import Any

from actors.runtime.failures import FIRST_LOGGED, SUMMARY_EVERY_S, FailureBreaker
from policies.rewards import RewardOutcome

__all__ = ["FIRST_LOGGED", "SUMMARY_EVERY_S", "RewardFailures"]


class RewardFailures(FailureBreaker):
    """Counts the outcomes of one reward function and logs its failures at a bounded rate."""

    def __init__(self, log: Any, function: str, *, limit: int, **timing: Any) -> None:
        super().__init__(log, f"reward function {function}", limit=limit, setting="reward_failure_limit",
                         what="reward", done="scored", fields={"reward_function": function}, **timing)
        self.function = function

    def record(self, sample_id: str, outcome: RewardOutcome) -> None:
        if outcome.status == "ok":
            self.succeeded()
        else:
            self.failed(sample_id, outcome.reason, outcome.trace)
