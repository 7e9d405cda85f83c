"""Run metrics: JSON lines always (what plots and audits read), TensorBoard when asked.

One writer per producing actor (`metrics/<name>.jsonl`), so processes never contend for a file; every record
carries the step and wall-clock seconds since the writer opened, so curves can be drawn against either.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


class MetricsWriter:
    def __init__(self, run_dir: Path, name: str, *, tensorboard: bool = False) -> None:
        directory = run_dir / "metrics"
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{name}.jsonl"
        self._file = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        self._started = time.time()
        self._tensorboard = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(log_dir=str(run_dir / "tensorboard" / name))

    def write(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        record = {"step": step, "time": round(time.time() - self._started, 3), "wall": time.time()}
        for key, value in metrics.items():
            record[key] = _plain(value)
        self._file.write(json.dumps(record) + "\n")
        if self._tensorboard is not None:
            for key, value in record.items():
                if key not in ("step", "wall") and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tensorboard.add_scalar(key, value, step)
            self._tensorboard.flush()
        return record

    def close(self) -> None:
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()


def _plain(value: Any) -> Any:
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN; null says "not finite" and keeps the line parseable
    return value


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line torn by a kill; the rest is still good
    return records
