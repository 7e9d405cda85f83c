"""Run metrics: JSON lines always (what plots and audits read), TensorBoard when asked.

One writer per producing actor (`metrics/<name>.jsonl`), so processes never contend for a file; every record
carries the step, `time` (seconds on the run's clock, `actors/report/run_clock.py`) and `wall` (epoch seconds),
so curves can be drawn against steps or time, and the time of every file goes on across restarts.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

TAIL_BYTES = 64 * 1024  # what `last_record` reads first; it reads more only for a longer last line


class MetricsWriter:
    def __init__(self, run_dir: Path, name: str, *, tensorboard: bool = False,
                 clock_origin: float | None = None) -> None:
        """`clock_origin`: the epoch seconds at which the run's clock read 0 (`ActorSettings.clock_origin`); without
        one (an actor started outside a launcher, a tool), `time` counts from this writer's opening."""
        directory = run_dir / "metrics"
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{name}.jsonl"
        self._file = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        self._origin = time.time() if clock_origin is None else clock_origin
        self._tensorboard = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(log_dir=str(run_dir / "tensorboard" / name))

    def write(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        record: dict[str, Any] = {"step": step, **clock_fields(self._origin)}
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


def clock_fields(origin: float | None) -> dict[str, float]:
    """What every metrics record carries: `time` on the run's clock (where it is known: the head's launcher gives
    it to the actors it starts) and `wall`, the epoch seconds."""
    now = time.time()
    return {"wall": now} if origin is None else {"time": round(now - origin, 3), "wall": now}


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


def last_record(path: Path) -> dict[str, Any] | None:
    """The last whole record of a metrics file, reading only its end (a long run's files reach hundreds of MB); None
    when the file is missing or holds no whole record."""
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            span = TAIL_BYTES
            while True:
                handle.seek(max(0, size - span))
                lines = handle.read().split(b"\n")
                if span < size:
                    lines = lines[1:]  # the first may start mid-line
                for line in reversed(lines):
                    try:
                        record = json.loads(line)
                    except (json.JSONDecodeError, UnicodeDecodeError):
                        continue  # empty, or torn by a kill
                    if isinstance(record, dict):
                        return record
                if span >= size:
                    return None
                span *= 4
    except OSError:
        return None
