"""Reading one pipeline-benchmark run from the real actors' outputs: its steady-state window and where time went.

Nothing here talks to a running actor. The learner's metrics file (metrics/train.jsonl, where the sleeping trainer
adds when its compute started and ended), the controller's record of every actor's heartbeat gauges
(metrics/actors.jsonl: the rollout workers' busy slot-seconds and send waits), the buffer's metrics, the
controller's log (when the run became "running") and /proc (CPU per actor) are all it reads.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from actors.runtime.metrics import read_metrics
from tools.sim.pipeline import SimSpec

CPU_ROLES = ("buffer", "reward", "controller", "learner", "rollout", "launcher")


@dataclass
class RunResult:
    mode: str
    workers: int
    max_staleness: int
    samples_per_s: float
    window_s: float
    measured_batches: int
    learner_wait_fraction: float  # share of the window from one step's end to the next step's compute
    rollout_busy_fraction: float  # share of the engines' group slots in flight during the window (5 s samples)
    fetch_ms: float  # median per step: previous step's end -> compute starts (includes waiting for the data)
    timer_ms: float  # median per step: how much longer the simulated compute took than its cost (timer lateness)
    after_ms: float  # median per step: compute ends -> step recorded (announce, weight publish, bookkeeping)
    send_ms: float  # mean wait of a generated group for the reward stream (back-pressure)
    staleness_mean: float
    staleness_max: int
    groups_evicted: int  # trained-too-late groups the buffer re-issued (wasted generation)
    cpu_cores: dict[str, float]  # CPU cores used per role during the window (2.0 = this whole machine)
    wall_s: float  # the whole run, start-up included
    run_dir: str


@dataclass(frozen=True)
class Window:
    """The steady-state window of one run: its bounds (wall clock) and the learner steps inside it."""

    start: float
    end: float
    steps: list[dict[str, Any]]
    before: dict[str, Any]  # the step that closed just before the window (its end is where `steps[0]` began)


def running_since(run_dir: Path) -> float | None:
    """When the controller declared the run "running" (every expected actor registered), from its log."""
    for record in read_metrics(run_dir / "logs" / "controller.jsonl"):
        if record.get("event") == "run state" and record.get("state") == "running":
            return datetime.fromisoformat(str(record["timestamp"]).replace("Z", "+00:00")).timestamp()
    return None


def steady_window(run_dir: Path, spec: SimSpec) -> Window | None:
    """The window once it is long enough: after start-up and the warm-up batches, >= measure_seconds and
    >= min_measured_batches; None while it is not (yet)."""
    running = running_since(run_dir)
    if running is None:
        return None
    steps = [s for s in read_metrics(run_dir / "metrics" / "train.jsonl") if "sim/compute_start" in s]
    started = [i for i, s in enumerate(steps) if s["sim/compute_start"] >= running]
    if len(started) <= spec.warmup_batches:
        return None
    first = started[spec.warmup_batches]
    # The window opens where the first measured step's fetch began: the end of the step before it, or start-up.
    before = steps[first - 1] if first > 0 and spec.warmup_batches > 0 else {"wall": running}
    window = Window(start=before["wall"], end=steps[-1]["wall"], steps=steps[first:], before=before)
    long_enough = window.end - window.start >= spec.measure_seconds
    return window if long_enough and len(window.steps) >= spec.min_measured_batches else None


def measure(mode: str, workers: int, max_staleness: int, run_dir: Path, window: Window,
            cpu_samples: list[tuple[float, dict[str, float]]], wall_s: float) -> RunResult:
    steps, length = window.steps, window.end - window.start
    previous_end = [window.before["wall"]] + [s["wall"] for s in steps[:-1]]
    fetches = [s["sim/compute_start"] - end for s, end in zip(steps, previous_end, strict=True)]
    busy, send_ms = _engine_gauges(run_dir, window)
    return RunResult(
        mode=mode, workers=workers, max_staleness=max_staleness,
        samples_per_s=sum(s["rollout/samples"] for s in steps) / length, window_s=length,
        measured_batches=len(steps), learner_wait_fraction=sum(fetches) / length, rollout_busy_fraction=busy,
        fetch_ms=1e3 * statistics.median(fetches),
        timer_ms=1e3 * statistics.median(s["sim/timer_late_s"] for s in steps),
        after_ms=1e3 * statistics.median(s["wall"] - s["sim/compute_end"] for s in steps), send_ms=send_ms,
        staleness_mean=statistics.fmean(s.get("staleness/mean", 0.0) for s in steps),
        staleness_max=int(max(s.get("staleness/max", 0.0) for s in steps)),
        groups_evicted=_groups_evicted(run_dir),
        cpu_cores=_cores_by_role(cpu_samples, window.start, window.end), wall_s=wall_s, run_dir=str(run_dir),
    )


def _engine_gauges(run_dir: Path, window: Window) -> tuple[float, float]:
    """Engines' busy share and mean send wait over the span of the controller's records around the window (they
    come every 5 s, so a short window may have none: NaN)."""
    records = read_metrics(run_dir / "metrics" / "actors.jsonl")
    first = next((r for r in reversed(records) if r["wall"] <= window.start), records[0] if records else None)
    last = next((r for r in reversed(records) if r["wall"] <= window.end), None)
    if first is None or last is None or last["wall"] - first["wall"] <= 0:
        return math.nan, math.nan

    def total(record: dict[str, Any], gauge: str) -> float:
        return sum(v for k, v in record.items() if k.startswith("rollout-") and k.endswith("/" + gauge))

    slots = total(last, "rollout.capacity_groups")
    busy = total(last, "rollout.busy_slot_seconds") - total(first, "rollout.busy_slot_seconds")
    sent = total(last, "groups.sent") - total(first, "groups.sent")
    waited = total(last, "rollout.send_seconds") - total(first, "rollout.send_seconds")
    span = last["wall"] - first["wall"]
    return (busy / (slots * span) if slots else math.nan), (1e3 * waited / sent if sent else math.nan)


def _groups_evicted(run_dir: Path) -> int:
    records = read_metrics(run_dir / "metrics" / "buffer.jsonl")
    return int(records[-1].get("buffer.dropped.stale_evicted", 0)) if records else 0


# ------------------------------------------------------------------------------------------- CPU use
def _role_of(actor_id: str) -> str:
    return actor_id.split("-", 1)[0]


def _cores_by_role(samples: list[tuple[float, dict[str, float]]], start: float, end: float) -> dict[str, float]:
    inside = [s for s in samples if start <= s[0] <= end]
    if len(inside) < 2:
        return {}
    (t0, first), (t1, last) = inside[0], inside[-1]
    cores = dict.fromkeys(CPU_ROLES, 0.0)
    for actor, seconds in last.items():
        if actor in first:
            role = _role_of(actor)
            cores[role] = cores.get(role, 0.0) + (seconds - first[actor]) / (t1 - t0)
    cores["total"] = sum(cores.values())
    return cores
