"""What of a batch's rollout metrics `train.jsonl` gets: the step's own, the families slime's --log-* switches add
(`actors.learner.slime_metrics`), and a say for slime's --custom-rollout-log-function-path hook, which sees them
all first and may add to them, or log the batch itself (a true return: none of them is written)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from actors.config import RunConfig
from actors.extensions.load import rollout_log_hook
from actors.learner.slime_metrics import slime_logging_metrics
from bus.schema import Batch


class RolloutLog:
    def __init__(self, config: RunConfig, log: Any, counters: Counter[str]) -> None:
        self.logging = config.logging
        self.max_response_len = config.rollout.rollout_max_response_len
        self.hook = rollout_log_hook(config, log, counters)

    def __call__(self, batch: Batch, rollout: dict[str, Any], rollout_time: float) -> dict[str, Any]:
        """The rollout metrics to write for `batch`; `rollout`: the step's (none for a batch not trained).

        The hook's `rollout_time` is what the learner knows of it: the seconds between this batch's arrival and the
        one before (in a steady run, what producing a batch takes; the learner does not see generation itself)."""
        shown = {**rollout, **slime_logging_metrics(batch.samples, self.logging, self.max_response_len)}
        if self.hook is not None and self.hook(batch.batch_id, batch.samples, shown, rollout_time):
            return {}
        return shown
