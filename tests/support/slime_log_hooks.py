"""slime-style logging hooks for launcher runs (`--custom-rollout-log-function-path`): each call is a JSON line in
the file the run's custom config names (`--custom-config-path` with `hook_log: PATH`), so a test reads what the
learner process handed the hook."""

from __future__ import annotations

import json


def log_rollout(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
    """slime's signature; a false return: the default rollout metrics are written too."""
    with open(args.hook_log, "a", encoding="utf-8") as file:
        file.write(json.dumps({"rollout_id": rollout_id, "samples": len(samples),
                               "rewards": [sample.reward for sample in samples],
                               "metrics": sorted(rollout_extra_metrics), "rollout_time": rollout_time}) + "\n")
    rollout_extra_metrics["rollout/hook_saw_samples"] = len(samples)
    return False
