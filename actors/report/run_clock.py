"""The run's clock: the `time` of every metrics record, and the wall-clock the end-of-run summary prints.

It counts the seconds the run has been running. The head's launcher keeps it in RUN_DIR/clock.json and gives its
origin to every actor (`ActorSettings.clock_origin`), so an actor the supervisor restarts goes on counting where
the one before it stopped, instead of from 0. A resumed run (the same command, the same run directory) continues
from where the interrupted one stopped: the hours a run sat stopped are not run time, and counting them would
put one long empty stretch in every plot against time and into the summary's wall-clock. `wall` in each record
is the calendar time, for anyone who wants the gaps.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actors.runtime.metrics import last_record

CLOCK_FILE = "clock.json"


@dataclass(frozen=True)
class RunClock:
    run_dir: Path
    origin: float  # the epoch seconds at which the run's clock read 0
    starts: int  # how many times the run was started, this one included

    @classmethod
    def start(cls, run_dir: Path, now: float | None = None) -> RunClock:
        """The head launcher's clock for this start of the run: from `now` for a new run, from where the last start
        stopped for a resumed one. Written to RUN_DIR/clock.json, which only the head's launcher writes."""
        now = time.time() if now is None else now
        saved = _read(run_dir)
        ran = run_seconds(run_dir)
        starts = int(saved.get("starts", 1)) + 1 if saved else (2 if ran is not None else 1)
        clock = cls(run_dir, origin=now - (ran or 0.0), starts=starts)
        clock._write(stopped_at=None)
        return clock

    def seconds(self, now: float | None = None) -> float:
        return (time.time() if now is None else now) - self.origin

    def stop(self, now: float | None = None) -> float:
        """Record the run's time at this launcher's end, which the next start of the run continues from."""
        elapsed = self.seconds(now)
        self._write(stopped_at=elapsed)
        return elapsed

    def _write(self, *, stopped_at: float | None) -> None:
        path = self.run_dir / CLOCK_FILE
        partial = path.with_name(CLOCK_FILE + ".partial")
        partial.write_text(json.dumps({"origin": self.origin, "starts": self.starts, "stopped_at": stopped_at}),
                           encoding="utf-8")
        os.replace(partial, path)  # a launcher killed mid-write leaves the old clock, never half of one


def run_seconds(run_dir: Path) -> float | None:
    """How long the run has been running: what its clock read when its launcher last stopped, or at the latest
    metrics record when that is later (the run is still going, or its launcher was killed before it could say);
    None for a run directory with neither."""
    saved = _read(run_dir)
    stopped = saved.get("stopped_at") if saved else None
    latest = [record["time"] for path in sorted((run_dir / "metrics").glob("*.jsonl"))
              if (record := last_record(path)) is not None and isinstance(record.get("time"), (int, float))]
    known = [float(value) for value in (stopped, *latest) if isinstance(value, (int, float))]
    return max(known) if known else None


def run_starts(run_dir: Path) -> int:
    """How many times the run was started (1 for a run directory without a clock)."""
    saved = _read(run_dir)
    return int(saved.get("starts", 1)) if saved else 1


def format_duration(seconds: float) -> str:
    """`3.4s`, `47s`, `2m 34s`, `1h 02m 05s`: a run of a few seconds does not read `0s`."""
    if seconds < 9.95:
        return f"{max(seconds, 0.0):.1f}s"
    whole = round(seconds)
    if whole < 60:
        return f"{whole}s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s"


def _read(run_dir: Path) -> dict[str, Any] | None:
    try:
        saved = json.loads((run_dir / CLOCK_FILE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return saved if isinstance(saved, dict) else None
