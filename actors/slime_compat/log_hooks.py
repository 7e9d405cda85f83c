"""slime's logging hooks, `--custom-rollout-log-function-path` and `--custom-eval-rollout-log-function-path`.

slime calls them where it logs a rollout's metrics, with what it logs them from:
``log_rollout_data(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool`` and
``log_eval_rollout_data(rollout_id, args, data, extra_metrics) -> bool``, ``data`` being
``{dataset: {"rewards": [...], "truncated": [...], "samples": [...]}}``. A true return means the hook logged
(or chose to drop) the rollout: slime's default logging is skipped. Otherwise slime logs the extra metrics along
with its own, so a hook that adds keys to that dict has them logged too; so do we.

Here the learner calls the rollout hook on each batch it trains and the evaluator calls the eval hook on each
round (one dataset per call: rounds finish a dataset at a time). ``rollout_id`` is slime's 0-based id: the batch's
id - 1, and for an eval round the id of the batch whose weights it evaluates (0 before training, as slime). The
metrics dict handed over is the one about to be written: the batch's rollout metrics, the round's eval metrics.
A hook that raises is reported with its path and the run goes on with the default logging.
"""

from __future__ import annotations

import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Self

from actors.config import RunConfig
from actors.slime_compat.args import build_args
from actors.slime_compat.sample import from_wire
from bus.schema import Sample as WireSample
from policies.plugins import load_callable

__all__ = ["SlimeEvalLogHook", "SlimeRolloutLogHook"]


class _Hook:
    setting: str  # the logging section's field that names the hook

    def __init__(self, fn: Callable[..., Any], path: str, config: RunConfig, log: Any, counters: Counter[str]
                 ) -> None:
        self.fn, self.path = fn, path
        self.flag = "--" + self.setting.replace("_", "-")
        self.args = build_args(config)
        self.log = log
        self.counters = counters

    @classmethod
    def load(cls, config: RunConfig, log: Any, counters: Counter[str]) -> Self | None:
        """The hook `config` names, or None; a path that does not load is an error naming the flag."""
        path = getattr(config.logging, cls.setting)
        if not path:
            return None
        return cls(load_callable(path, what="--" + cls.setting.replace("_", "-")), path, config, log, counters)

    def _call(self, *arguments: Any) -> bool:
        """The hook's verdict, "skip the default logging"; False when it raised (reported, counted)."""
        try:
            return bool(self.fn(*arguments))
        except Exception as error:  # a user's logging must not stop training: reported, and the default goes on
            self.counters["log_hook.failures"] += 1
            self.log.warning("logging hook raised; the default metrics are written", flag=self.flag, hook=self.path,
                             error=repr(error), traceback=traceback.format_exc(limit=-3))
            return False


class SlimeRolloutLogHook(_Hook):
    setting = "custom_rollout_log_function_path"

    def __call__(self, batch_id: int, samples: Sequence[WireSample], metrics: dict[str, Any],
                 rollout_time: float) -> bool:
        """Call the hook on a batch; `metrics` (the batch's rollout metrics) may gain keys. True: leave them out."""
        return self._call(batch_id - 1, self.args, [from_wire(s) for s in samples], metrics, rollout_time)


class SlimeEvalLogHook(_Hook):
    setting = "custom_eval_rollout_log_function_path"

    def __call__(self, version: int, dataset: str, samples: Sequence[WireSample], metrics: dict[str, Any]) -> bool:
        """Call the hook on an eval round of `dataset` at `version`; `samples` are its scored ones (an agent's
        episode by its final segment). True: leave the round's default metrics out."""
        data = {dataset: {"rewards": [float(s.reward) for s in samples if s.reward is not None],
                          "truncated": [s.status == "truncated" for s in samples if s.reward is not None],
                          "samples": [from_wire(s) for s in samples if s.reward is not None]}}
        return self._call(max(version - 1, 0), self.args, data, metrics)
