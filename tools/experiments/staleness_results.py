"""The staleness sweep's results: per-run records, per-cell summaries, tables, the plot and the JSON file.

Kept apart from `tools/experiments/staleness.py`, which runs the sweep, so `--from-json` analysis (and its tests)
need none of the run machinery.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from actors.runtime.metrics import read_metrics

Curve = list[tuple[int, float, float]]  # (learner version, seconds on the learner's clock, value)


@dataclass(frozen=True)
class Cell:
    max_staleness: int
    correction: str

    @property
    def label(self) -> str:
        return f"staleness {self.max_staleness}, {self.correction}"


@dataclass
class RunResult:
    """One launcher run: its held-out `curve`, its per-step training reward, and how long and how loaded it was."""

    max_staleness: int
    correction: str
    seed: int
    run_dir: str
    returncode: int
    process_seconds: float
    wall_clock: float | None = None
    final_accuracy: float | None = None
    curve: Curve = field(default_factory=list)
    reward_steps: Curve = field(default_factory=list)  # rollout/reward_mean of every trained batch
    mean_staleness: float | None = None
    mean_load: float | None = None
    error: str | None = None

    @property
    def cell(self) -> Cell:
        return Cell(self.max_staleness, self.correction)

    @property
    def ok(self) -> bool:
        return self.error is None and self.final_accuracy is not None and self.wall_clock is not None




def learner_origin(run_dir: Path) -> float | None:
    """Epoch seconds at which the learner's clock reads 0: its "actor started" log event, just after it opened its
    metrics. The metrics' own `time` is the run's clock, which counts process start-up too."""
    for record in read_metrics(run_dir / "logs" / "learner.jsonl"):
        if record.get("event") == "actor started" and isinstance(record.get("timestamp"), str):
            return datetime.fromisoformat(record["timestamp"]).timestamp()
    return None


def read_reward_steps(train: list[dict[str, Any]], origin: float) -> Curve:
    """(version, learner-clock seconds, training reward) of every trained batch; `origin` from `learner_origin`."""
    return [
        (int(r["version"]), float(r["wall"]) - origin, float(r["rollout/reward_mean"]))
        for r in train
        if isinstance(r.get("rollout/reward_mean"), (int, float)) and isinstance(r.get("version"), int)
        and isinstance(r.get("wall"), (int, float))
    ]


def first_reach(curve: Curve, target: float) -> tuple[int, float] | None:
    """(version, learner-clock seconds) of the first point at or above `target`; None if never reached."""
    for version, seconds, value in curve:
        if value >= target - 1e-9:
            return version, seconds
    return None


def time_to_reach(curve: Curve, target: float) -> float | None:
    reached = first_reach(curve, target)
    return None if reached is None else reached[1]


def trailing_mean(steps: Curve, window: int) -> Curve:
    """Mean of the last `window` points at each point from the window-th on (the whole run if it is shorter).

    One batch's reward (64 samples) is too noisy to ask when a run first reached a level; a window is not.
    """
    window = max(1, min(window, len(steps)))
    values = [value for _, _, value in steps]
    return [
        (version, seconds, sum(values[i + 1 - window : i + 1]) / window)
        for i, (version, seconds, _) in enumerate(steps)
        if i + 1 >= window
    ]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _std(values: list[float]) -> float | None:
    if not values:
        return None
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


@dataclass
class CellSummary:
    """One cell over its seeds, for one metric; "target" is the sync runs' final value of that metric."""

    cell: Cell
    runs: int
    final_mean: float | None
    final_std: float | None
    lowest_mean: float | None  # mean over seeds of the lowest point: a collapse shows here, not in the final value
    reached: int
    versions_to_target_mean: float | None  # over the seeds that reached it: sample efficiency, load-independent
    time_to_target_mean: float | None
    target_ratio: float | None  # time to target / sync wall-clock: the issue's <= 0.6 criterion
    wall_clock_mean: float | None
    wall_clock_ratio: float | None
    steps_per_second: float | None  # learner throughput: the factor that machine load moves
    mean_staleness: float | None
    mean_load: float | None


@dataclass
class Summary:
    metric: str
    target: float
    sync_wall_clock: float
    cells: list[CellSummary]


def summarize(results: list[RunResult], curve_of: Callable[[RunResult], Curve], metric: str) -> Summary:
    """Per-cell figures for one metric; the reference pools every successful max_staleness=0 run."""
    runs_ok = [r for r in results if r.ok and curve_of(r)]
    sync = [r for r in runs_ok if r.max_staleness == 0]
    if not sync:
        raise ValueError(
            "no successful --max-staleness 0 run: the sync reference is undefined (include 0 in --staleness)"
        )
    target = sum(curve_of(r)[-1][2] for r in sync) / len(sync)
    sync_wall = sum(r.wall_clock for r in sync) / len(sync)  # type: ignore[misc]
    cells = []
    for cell in sorted({r.cell for r in results}, key=lambda c: (c.max_staleness, c.correction)):
        runs = [r for r in runs_ok if r.cell == cell]
        reaches = [hit for r in runs if (hit := first_reach(curve_of(r), target)) is not None]
        finals = [curve_of(r)[-1][2] for r in runs]
        reach_time = _mean([seconds for _, seconds in reaches])
        wall = _mean([r.wall_clock for r in runs])  # type: ignore[misc]
        cells.append(
            CellSummary(
                cell=cell,
                runs=len(runs),
                final_mean=_mean(finals),
                final_std=_std(finals),
                lowest_mean=_mean([min(p[2] for p in curve_of(r)) for r in runs]),
                reached=len(reaches),
                versions_to_target_mean=_mean([float(v) for v, _ in reaches]),
                time_to_target_mean=reach_time,
                target_ratio=None if reach_time is None else reach_time / sync_wall,
                wall_clock_mean=wall,
                wall_clock_ratio=None if wall is None else wall / sync_wall,
                steps_per_second=_mean([r.curve[-1][0] / r.wall_clock for r in runs if r.wall_clock]),  # type: ignore[misc]
                mean_staleness=_mean([r.mean_staleness for r in runs if r.mean_staleness is not None]),
                mean_load=_mean([r.mean_load for r in runs if r.mean_load is not None]),
            )
        )
    return Summary(metric=metric, target=target, sync_wall_clock=sync_wall, cells=cells)


def split_by_load(results: list[RunResult], max_run_load: float | None) -> tuple[list[RunResult], list[RunResult]]:
    """(kept, excluded): runs whose mean load average exceeded `max_run_load` measured the neighbours, not us."""
    if max_run_load is None:
        return results, []
    excluded = [r for r in results if r.mean_load is not None and r.mean_load > max_run_load]
    return [r for r in results if r not in excluded], excluded


# ------------------------------------------------------------------------------------------------ tables
def _number(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _markdown(header: list[str], rows: list[list[str]], left: tuple[str, ...] = ("correction",)) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "| " + " | ".join("---" if name in left else "---:" for name in header) + " |",
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def format_runs_table(summary: Summary) -> str:
    """Throughput: what each cell cost in wall-clock, and how loaded the machine was meanwhile."""
    header = [
        "max staleness",
        "correction",
        "runs",
        "mean staleness",
        "load avg",
        "wall-clock (s)",
        "wall / sync",
        "steps/s",
    ]
    rows = [
        [
            str(c.cell.max_staleness),
            c.cell.correction,
            str(c.runs),
            _number(c.mean_staleness, ".2f"),
            _number(c.mean_load, ".1f"),
            _number(c.wall_clock_mean, ".1f"),
            _number(c.wall_clock_ratio, ".2f"),
            _number(c.steps_per_second, ".2f"),
        ]
        for c in summary.cells
    ]
    return "\n".join(_markdown(header, rows))


def format_metric_table(summary: Summary) -> str:
    """One metric: final value, worst point, and when (in versions and in seconds) it reached the sync target."""
    header = [
        "max staleness",
        "correction",
        f"final {summary.metric}",
        "lowest",
        "reached target",
        "versions to target",
        "time to target (s)",
        "time to target / sync wall",
    ]
    rows = [
        [
            str(c.cell.max_staleness),
            c.cell.correction,
            "—" if c.final_mean is None else f"{c.final_mean:.3f} ± {c.final_std:.3f}",
            _number(c.lowest_mean, ".3f"),
            f"{c.reached}/{c.runs}",
            _number(c.versions_to_target_mean, ".0f"),
            _number(c.time_to_target_mean, ".1f"),
            _number(c.target_ratio, ".2f"),
        ]
        for c in summary.cells
    ]
    return "\n".join(
        [
            f"target = sync runs' mean final {summary.metric}: {summary.target:.3f}; sync wall-clock "
            f"{summary.sync_wall_clock:.1f}s",
            "",
            *_markdown(header, rows),
        ]
    )


# ------------------------------------------------------------------------------------------------ plot
def mean_curve(curves: list[Curve]) -> list[tuple[float, float]]:
    """Seeds averaged version by version: (mean seconds, mean value), over the seeds that have that version."""
    by_version: dict[int, list[tuple[float, float]]] = {}
    for curve in curves:
        for version, seconds, value in curve:
            by_version.setdefault(version, []).append((seconds, value))
    return [
        (sum(p[0] for p in points) / len(points), sum(p[1] for p in points) / len(points))
        for _, points in sorted(by_version.items())
    ]


def plot(results: list[RunResult], panels: list[tuple[Summary, Callable[[RunResult], Curve]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = sorted({r.cell for r in results if r.ok}, key=lambda c: (c.max_staleness, c.correction))
    staleness_values = sorted({c.max_staleness for c in cells})
    corrections = sorted({c.correction for c in cells}, reverse=True)
    styles = ["-", "--", ":", "-."]
    figure, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    for axis, (summary, curve_of) in zip(axes[0], panels, strict=True):
        for cell in cells:
            points = mean_curve([curve_of(r) for r in results if r.cell == cell and r.ok])
            if not points:
                continue
            xs, ys = zip(*points, strict=True)
            shade = staleness_values.index(cell.max_staleness) / max(1, len(staleness_values) - 1) * 0.85
            axis.plot(
                xs,
                ys,
                styles[corrections.index(cell.correction) % len(styles)],
                color=plt.cm.viridis(shade),
                marker="o" if len(points) <= 20 else None,
                markersize=3,
                label=cell.label,
            )
        axis.axhline(
            summary.target, color="grey", linewidth=0.8, linestyle=":", label=f"sync final {summary.target:.3f}"
        )
        axis.axvline(
            0.6 * summary.sync_wall_clock, color="red", linewidth=0.8, linestyle=":", label="0.6 x sync wall-clock"
        )
        axis.set_xlabel("seconds since the learner started (mean over seeds)")
        axis.set_ylabel(summary.metric)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7, loc="lower right")
    seeds = len({r.seed for r in results})
    figure.suptitle(f"GRPO on addition, max staleness x off-policy correction, {seeds} seed(s) per cell", fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=80)
    plt.close(figure)


# ------------------------------------------------------------------------------------------------ output
def write_json(path: Path, results: list[RunResult], summaries: list[Summary], settings: dict[str, Any]) -> None:
    payload = {
        "settings": settings,
        "summaries": [
            {
                "metric": s.metric,
                "target": s.target,
                "sync_wall_clock": s.sync_wall_clock,
                "cells": [{**asdict(c), "cell": asdict(c.cell)} for c in s.cells],
            }
            for s in summaries
        ],
        "runs": [asdict(r) for r in results],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")


def load_results(path: Path) -> tuple[list[RunResult], dict[str, Any]]:
    """Runs of an earlier --json; a run written before `reward_steps` existed gets them from its run directory."""
    payload = json.loads(path.read_text(encoding="utf-8"))
    runs = []
    for index, run in enumerate(payload.get("runs", [])):
        try:
            run["curve"] = [tuple(p) for p in run["curve"]]
            run["reward_steps"] = [tuple(p) for p in run.get("reward_steps", [])]
            result = RunResult(**run)
        except (KeyError, TypeError) as error:
            raise ValueError(f"{path}: runs[{index}] is not a run record: {error}") from error
        if not result.reward_steps and (origin := learner_origin(Path(result.run_dir))) is not None:
            train = read_metrics(Path(result.run_dir) / "metrics" / "train.jsonl")
            result.reward_steps = read_reward_steps(train, origin)
        runs.append(result)
    return runs, payload.get("settings", {})


def report(
    results: list[RunResult],
    settings: dict[str, Any],
    *,
    json_path: Path | None,
    plot_path: Path,
    reward_window: int,
    max_run_load: float | None,
) -> None:
    for run in results:
        if not run.ok:
            print(f"FAILED staleness {run.max_staleness} {run.correction} seed {run.seed}: {run.error}", flush=True)
    kept, excluded = split_by_load(results, max_run_load)
    for run in excluded:
        print(
            f"left out (mean load average {run.mean_load:.1f} > {max_run_load}): staleness {run.max_staleness} "
            f"{run.correction} seed {run.seed}",
            flush=True,
        )

    def heldout(run: RunResult) -> Curve:
        return run.curve

    def reward(run: RunResult) -> Curve:
        return trailing_mean(run.reward_steps, reward_window)

    try:
        summaries = [
            summarize(kept, heldout, "held-out accuracy"),
            summarize(kept, reward, f"train reward ({reward_window}-step mean)"),
        ]
    except ValueError as error:  # keep what was measured even when the comparison is impossible
        if json_path is not None:
            write_json(json_path, results, [], settings)
        raise SystemExit(f"experiment: {error}; per-run results in {json_path}") from error
    print("\n" + format_runs_table(summaries[0]))
    for summary in summaries:
        print("\n" + format_metric_table(summary))
    plot(kept, [(summaries[0], heldout), (summaries[1], reward)], plot_path)
    print(f"\nplot: {plot_path}")
    if json_path is not None:
        write_json(
            json_path, results, summaries, {**settings, "reward_window": reward_window, "max_run_load": max_run_load}
        )
        print(f"json: {json_path}")


