"""Weights & Biases, when enabled (`--use-wandb`): the run's metrics JSONL files, mirrored into one W&B run.

Why a mirror and not a W&B call in each actor: the learner, buffer and controller each write their own
`metrics/<name>.jsonl`, and W&B wants one writer per run. The controller (one per run, on the head node, next
to the run directory) tails every metrics file and forwards new records, so no actor depends on W&B being
reachable, and a W&B outage costs W&B only: the JSONL files stay complete.

Keys are namespaced by file (`train/loss`, `eval/heldout/accuracy`, `buffer/...`), and each file gets its own
x-axis `<file>/step` (the learner version for train and eval) via `define_metric`, so curves from files written
at different rates line up. The W&B run id and each file's byte offset are kept in `RUN_DIR/wandb/`, so a
restarted controller resumes the same W&B run without sending a record twice. `--wandb-run-id` names the W&B run
instead (slime's flag): a run resumed from another run directory's checkpoint goes on in its predecessor's W&B run.
"""

from __future__ import annotations

import json
import math
import os
import uuid
from pathlib import Path
from typing import Any

import structlog

STATE_FILE = "mirror_state.json"


class WandbMirror:
    def __init__(self, run_dir: Path, *, project: str, group: str | None, mode: str, config: dict[str, Any],
                 run_id: str | None = None) -> None:
        """`run_id` (slime's --wandb-run-id): the W&B run to log into, resumed where it exists; without it, the run
        this directory logged into before, or a new one."""
        import wandb

        self.metrics_dir = run_dir / "metrics"
        self.state_dir = run_dir / "wandb"
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.log = structlog.get_logger("wandb_mirror")
        state = self._read_state()
        chosen = run_id or state.get("run_id") or uuid.uuid4().hex[:12]
        # Offsets say what a W&B run already holds: another run than the one they were kept for holds nothing yet.
        self.offsets: dict[str, int] = state.get("offsets", {}) if state.get("run_id") == chosen else {}
        self.axes: set[str] = set()
        self.run = wandb.init(
            project=project,
            group=group,
            name=run_dir.name,
            id=chosen,
            resume="allow",
            mode=mode,
            dir=str(self.state_dir),
            config=config,
        )
        self._write_state()

    def pump(self) -> int:
        """Forward every complete line appended since the last call; return how many records went out."""
        sent = 0
        for path in sorted(self.metrics_dir.glob("*.jsonl")):
            name = path.stem
            if name == "trained_samples":
                continue  # the audit trail: sample ids, not metrics
            sent += self._forward(name, path)
        if sent:
            self._write_state()
        return sent

    def close(self) -> None:
        self.pump()
        self.run.finish()

    def _forward(self, name: str, path: Path) -> int:
        start = self.offsets.get(name, 0)
        with open(path, "rb") as file:
            file.seek(start)
            chunk = file.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits for the next pump
        sent = 0
        for line in complete.splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                self.log.warning("metrics line is not JSON; not sent to W&B", file=str(path), line=line[:200])
                continue
            self._log_record(name, record)
            sent += 1
        self.offsets[name] = start + len(complete)
        return sent

    def _log_record(self, name: str, record: dict[str, Any]) -> None:
        axis = f"{name}/step"
        if axis not in self.axes:
            self.run.define_metric(axis)
            self.run.define_metric(f"{name}/*", step_metric=axis)
            self.axes.add(axis)
        values: dict[str, Any] = {axis: record.get("step", 0)}
        for key, value in record.items():
            if key in ("step", "wall") or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            if math.isfinite(value):
                values[key if key.startswith(f"{name}/") else f"{name}/{key}"] = value
        self.run.log(values)

    def _read_state(self) -> dict[str, Any]:
        path = self.state_dir / STATE_FILE
        return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}

    def _write_state(self) -> None:
        staging = self.state_dir / f"{STATE_FILE}.{os.getpid()}.tmp"
        staging.write_text(json.dumps({"run_id": self.run.id, "offsets": self.offsets}), encoding="utf-8")
        os.replace(staging, self.state_dir / STATE_FILE)
