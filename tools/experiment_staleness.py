"""Staleness x off-policy-correction sweep: held-out accuracy against wall-clock, sync vs fully-async.

`python tools/experiment_staleness.py --seeds 1 2 --staleness 0 1 2 4 --corrections none tis --json out.json`

1. One SFT warm start of the demo's tiny model on the demo's addition task, cached under
   `.cache/experiments/sft-<key>` where the key hashes everything that determines it (model spec, data, SFT
   flags), so sweeps and reruns share it.
2. One `launcher.py` GRPO run per (max_staleness, correction, seed) cell, each in its own run directory under
   `runs/experiments/<stamp>/`, with a held-out eval round every `--eval-interval` versions.
3. Per run: the held-out curve (accuracy of each eval round, at the moment the round finished), the final
   accuracy (the exported final model, scored greedily with `tools/evaluate.py` and placed at the learner's
   last step), the training reward of every batch, the wall-clock to finish and the machine's load meanwhile.
4. Three Markdown tables (throughput; held-out accuracy; training reward), `--json`, and a two-panel plot of
   both metrics against wall-clock, one line per cell. `--from-json` redoes them without running anything.

Decisions worth knowing when reading the numbers:
- Wall-clock is the learner's clock: seconds since the learner opened its metrics, which is how
  `metrics/train.jsonl` stamps steps. Process start-up (the same for every cell) is left out of the ratios and
  kept in the JSON as `process_seconds`.
- The target accuracy is the mean over seeds of the synchronous runs' final accuracy, pooled over
  corrections: at `--max-staleness 0` the behaviour and proximal policies are the same weights, so a
  correction only multiplies by ~1 and the sync runs are replicates of one algorithm.
- Time-to-target is the finish time of the first eval round at or above the target. Eval rounds are sparse
  (every `--eval-interval` versions), so this is an upper bound with that resolution.
- The training reward (mean reward of the batches the learner trained on, averaged over `--reward-window`
  steps) is the second metric because it is far less noisy than a small held-out set (64 samples per step
  against 80 greedy answers per round). It is measured on samples from the behaviour policy, which lags the
  learner by the staleness, so it is conservative for the async cells.
- Every run uses `--use-decoupled-ppo` by default, so every cell recomputes pi_old on the learner and `none`
  and `tis` differ only in the TIS weight pi_old/mu. (With a correction on, the learner recomputes pi_old
  anyway; without one and without decoupled PPO it would take pi_old := mu, a second difference between cells.)
- Cells run seed-major (every cell of seed 1, then of seed 2, ...) so slow drift in background load on a
  shared machine lands on all cells alike rather than on whichever cells ran last. The mean 1-minute load
  average during each run is recorded, `--max-load` waits (bounded) for a calmer machine before each run,
  `--max-run-load` leaves over-loaded runs out of the analysis, and the tables split the wall-clock ratio into
  its two factors: versions to target (sample efficiency, which load does not touch) and learner steps per
  second (throughput, which it does).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from actors.metrics import read_metrics
from engines.tiny_model import cached_tiny_model
from tools.demo import COMMON, GRPO, MAX_OPERAND, MODEL_SPEC, SFT
from tools.evaluate import evaluate_model
from tools.make_arithmetic_data import make_arithmetic_data

REPO = Path(__file__).resolve().parent.parent

EVAL_NAME = "heldout"
DATA_SETTINGS = {"max_operand": MAX_OPERAND, "eval_size": 80, "sft_size": 320, "seed": 0}
LOAD_SAMPLE_SECONDS = 2.0
QUICK = {
    "seeds": [1],
    "staleness": [0, 2],
    "corrections": ["tis"],
    "num_rollout": 12,
    "eval_interval": 6,
    "sft_steps": 0,
    "rollout_workers": 1,
}


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


# ------------------------------------------------------------------------------------------------ arguments
def override_flags(arguments: list[str], values: dict[str, str | None]) -> list[str]:
    """`arguments` without the flags in `values`, then each flag given a non-None value appended with it.

    Every flag touched here takes exactly one value or is a bare switch (value None removes it).
    """
    switches = {"--use-decoupled-ppo", "--no-use-decoupled-ppo"}
    kept: list[str] = []
    index = 0
    while index < len(arguments):
        flag = arguments[index]
        if flag in values:
            index += 1 if flag in switches else 2
            continue
        kept.append(flag)
        index += 1
    for flag, value in values.items():
        if value is not None:
            kept.extend([flag] if value == "" else [flag, value])
    return kept


def grpo_arguments(
    cell: Cell, seed: int, *, num_rollout: int, eval_interval: int, rollout_workers: int, decoupled_ppo: bool
) -> list[str]:
    """The demo's GRPO recipe with this run's cell, seed and schedule swapped in: the same task everywhere."""
    per_run = {
        "--num-rollout": str(num_rollout),
        "--max-staleness": str(cell.max_staleness),
        "--off-policy-correction": cell.correction,
        "--eval-interval": str(eval_interval),
        "--rollout-workers": str(rollout_workers),
        "--seed": str(seed),
        "--use-decoupled-ppo": "" if decoupled_ppo else None,
        "--no-use-decoupled-ppo": None,
    }
    return override_flags(GRPO, per_run)


# ------------------------------------------------------------------------------------------------ launcher
@dataclass
class LauncherOutcome:
    returncode: int
    seconds: float
    mean_load: float  # mean 1-minute load average while it ran: how contended the shared CPU was


def run_launcher(arguments: list[str], log_path: Path, *, timeout: float) -> LauncherOutcome:
    """Run launcher.py to completion with its output in `log_path`, sampling the machine's load meanwhile.

    The launcher leads its own process group, so a timeout can stop it and every actor it started.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    loads: list[float] = []
    with open(log_path, "w", encoding="utf-8") as log:
        process = subprocess.Popen(
            [sys.executable, "launcher.py", "--no-progress", *arguments],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        code: int | None = None
        while code is None and time.monotonic() - started < timeout:
            try:
                code = process.wait(timeout=LOAD_SAMPLE_SECONDS)
            except subprocess.TimeoutExpired:
                loads.append(os.getloadavg()[0])
        if code is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            code = 124
    mean_load = sum(loads) / len(loads) if loads else os.getloadavg()[0]
    return LauncherOutcome(code, time.monotonic() - started, round(mean_load, 2))


def wait_for_quiet_machine(max_load: float | None, max_wait: float) -> float:
    """Wait (at most `max_wait` s) until the 1-minute load average is under `max_load`; returns the load found.

    On a shared machine another user's burst can triple one run's wall-clock; waiting it out before a run
    starts is cheaper than rerunning the sweep. The load during each run is recorded either way.
    """
    deadline = time.monotonic() + max_wait
    load = os.getloadavg()[0]
    announced = False
    while max_load is not None and load >= max_load and time.monotonic() < deadline:
        if not announced:
            print(f"         waiting for the load average ({load:.1f}) to drop under {max_load}", flush=True)
            announced = True
        time.sleep(LOAD_SAMPLE_SECONDS)
        load = os.getloadavg()[0]
    return load


def log_tail(path: Path, lines: int = 5) -> str:
    if not path.exists():
        return ""
    return " | ".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])


# ------------------------------------------------------------------------------------------------ warm start
def warm_start_key(sft_arguments: list[str]) -> str:
    settings = {"model": asdict(MODEL_SPEC), "data": DATA_SETTINGS, "sft": sft_arguments, "common": COMMON}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


def prepare_warm_start(
    cache_dir: Path, workdir: Path, *, sft_steps: int, timeout: float
) -> tuple[Path, dict[str, Path]]:
    """The SFT-warm-started model and the task data, built once per settings and reused from the cache.

    `sft_steps=0` skips the warm start: GRPO starts from the untrained model (the smoke run's shortcut).
    """
    sft_arguments = override_flags(SFT, {"--num-rollout": str(sft_steps)})
    entry = cache_dir / "experiments" / f"sft-{warm_start_key(sft_arguments)}"
    data = make_arithmetic_data(entry / "data", **DATA_SETTINGS)
    base = cached_tiny_model(cache_dir / "models", MODEL_SPEC)
    if sft_steps == 0:
        print(f"warm start: none, GRPO starts from {base}", flush=True)
        return base, data
    model = entry / "model"
    if (model / "config.json").exists():
        print(f"warm start: cached {model}", flush=True)
        return model, data
    sft_dir = workdir / "sft"
    print(f"warm start: SFT for {sft_steps} steps -> {sft_dir}", flush=True)
    outcome = run_launcher(
        [
            "--head",
            "--run-dir",
            str(sft_dir),
            "--hf-checkpoint",
            str(base),
            "--prompt-data",
            str(data["sft"]),
            *COMMON,
            *sft_arguments,
        ],
        sft_dir.with_suffix(".log"),
        timeout=timeout,
    )
    if outcome.returncode != 0 or not (sft_dir / "final_model" / "config.json").exists():
        raise SystemExit(
            f"experiment: the SFT warm start failed (exit {outcome.returncode}); see "
            f"{sft_dir.with_suffix('.log')}: {log_tail(sft_dir.with_suffix('.log'))}"
        )
    staging = entry / f"model.{os.getpid()}.partial"
    shutil.copytree(sft_dir / "final_model", staging)
    staging.rename(model)  # atomic: a half-copied model is never mistaken for a cached one
    print(f"warm start: done in {outcome.seconds:.0f}s, cached at {model}", flush=True)
    return model, data


# ------------------------------------------------------------------------------------------------ one run
def learner_origin(train: list[dict[str, Any]]) -> float | None:
    """Epoch seconds at which the learner's clock reads 0 (each record has `wall` and `time` since then)."""
    for record in train:
        if isinstance(record.get("wall"), (int, float)) and isinstance(record.get("time"), (int, float)):
            return float(record["wall"]) - float(record["time"])
    return None


def eval_curve(metrics_dir: Path, origin: float, eval_name: str = EVAL_NAME) -> list[tuple[int, float, float]]:
    """Eval rounds from whichever metrics file holds them, as (version, learner-clock seconds, accuracy).

    Rounds are found by key rather than file name: the buffer writes them, and which file it uses is its business.
    """
    key = f"eval/{eval_name}/accuracy"
    points: dict[int, tuple[int, float, float]] = {}
    for path in sorted(metrics_dir.glob("*.jsonl")):
        for record in read_metrics(path):
            value = record.get(key)
            if isinstance(value, (int, float)) and isinstance(record.get("wall"), (int, float)):
                version = int(record["step"])
                points[version] = (version, max(0.0, float(record["wall"]) - origin), float(value))
    return [points[v] for v in sorted(points)]


def read_reward_steps(train: list[dict[str, Any]]) -> Curve:
    return [
        (int(r["version"]), float(r["time"]), float(r["rollout/reward_mean"]))
        for r in train
        if isinstance(r.get("rollout/reward_mean"), (int, float)) and isinstance(r.get("version"), int)
    ]


def run_one(
    cell: Cell,
    seed: int,
    *,
    model: Path,
    data: dict[str, Path],
    run_dir: Path,
    num_rollout: int,
    eval_interval: int,
    rollout_workers: int,
    decoupled_ppo: bool,
    timeout: float,
) -> RunResult:
    arguments = [
        "--head",
        "--run-dir",
        str(run_dir),
        "--hf-checkpoint",
        str(model),
        "--prompt-data",
        str(data["train"]),
        "--eval-prompt-data",
        EVAL_NAME,
        str(data["eval"]),
        "--no-plots",
        *COMMON,
        *grpo_arguments(
            cell,
            seed,
            num_rollout=num_rollout,
            eval_interval=eval_interval,
            rollout_workers=rollout_workers,
            decoupled_ppo=decoupled_ppo,
        ),
    ]
    log_path = run_dir / "launcher.out"
    outcome = run_launcher(arguments, log_path, timeout=timeout)
    result = RunResult(
        cell.max_staleness,
        cell.correction,
        seed,
        str(run_dir),
        outcome.returncode,
        round(outcome.seconds, 2),
        mean_load=outcome.mean_load,
    )
    train = read_metrics(run_dir / "metrics" / "train.jsonl")
    final_model = run_dir / "final_model"
    if outcome.returncode != 0 or not train or not (final_model / "config.json").exists():
        result.error = (
            f"launcher exit {outcome.returncode}, {len(train)} steps logged; see {log_path}: {log_tail(log_path)}"
        )
        return result
    origin = learner_origin(train)
    assert origin is not None  # every MetricsWriter record has both fields
    result.wall_clock = float(train[-1]["time"])
    stale = [r["staleness/mean"] for r in train if isinstance(r.get("staleness/mean"), (int, float))]
    result.mean_staleness = sum(stale) / len(stale) if stale else None
    result.reward_steps = read_reward_steps(train)
    curve = [p for p in eval_curve(run_dir / "metrics", origin) if p[0] < int(train[-1]["version"])]
    # The last round is usually cut off by the run's stop; score the exported model instead, at the last step.
    final = asyncio.run(evaluate_model(final_model, data["eval"], max_new_tokens=4))["accuracy"]
    result.final_accuracy = final
    result.curve = [*curve, (int(train[-1]["version"]), result.wall_clock, final)]
    return result


# ------------------------------------------------------------------------------------------------ analysis
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
        if not result.reward_steps:
            result.reward_steps = read_reward_steps(read_metrics(Path(result.run_dir) / "metrics" / "train.jsonl"))
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


# ------------------------------------------------------------------------------------------------ main
def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--staleness",
        type=int,
        nargs="+",
        default=[0, 1, 2, 4],
        help="--max-staleness values; 0 (sync) is the reference and must be included",
    )
    parser.add_argument("--corrections", nargs="+", default=["none", "tis"])
    parser.add_argument("--num-rollout", type=int, default=300, help="learner steps per run")
    parser.add_argument("--eval-interval", type=int, default=50, help="held-out eval every N versions")
    parser.add_argument(
        "--sft-steps",
        type=int,
        default=int(SFT[SFT.index("--num-rollout") + 1]),
        help="SFT warm-start steps (the demo's by default; 0 = start GRPO from the untrained model)",
    )
    parser.add_argument("--rollout-workers", type=int, default=int(GRPO[GRPO.index("--rollout-workers") + 1]))
    parser.add_argument(
        "--decoupled-ppo",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="recompute pi_old on the learner (without it TIS is a no-op: pi_old is mu)",
    )
    parser.add_argument("--run-timeout", type=float, default=900.0, help="seconds before one run is stopped")
    parser.add_argument(
        "--max-load",
        type=float,
        default=None,
        help="before each run, wait until the 1-minute load average is under this (shared machines)",
    )
    parser.add_argument("--max-load-wait", type=float, default=300.0, help="longest wait for --max-load, seconds")
    parser.add_argument(
        "--reward-window", type=int, default=25, help="learner steps averaged for the training-reward curve"
    )
    parser.add_argument(
        "--max-run-load",
        type=float,
        default=None,
        help="analysis: leave out runs whose mean load average exceeded this",
    )
    parser.add_argument("--workdir", type=Path, default=None, help="default runs/experiments/<stamp>")
    parser.add_argument("--cache-dir", type=Path, default=REPO / ".cache")
    parser.add_argument("--json", type=Path, default=None, help="write settings, per-cell and per-run figures")
    parser.add_argument("--plot", type=Path, default=None, help="PNG path (default WORKDIR/staleness_accuracy.png)")
    parser.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="redo the tables and plot from an earlier --json file, running nothing",
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 1 seed, staleness 0 and 2 with tis, 12 steps, no warm start"
    )
    args = parser.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    if 0 not in args.staleness and args.from_json is None:
        parser.error("--staleness must include 0: the synchronous runs are the reference")
    if any(s < 0 for s in args.staleness) or args.sft_steps < 0:
        parser.error("--staleness values and --sft-steps must be >= 0")
    if min(args.num_rollout, args.eval_interval, args.reward_window) < 1:
        parser.error("--num-rollout, --eval-interval and --reward-window must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_arguments(argv)
    workdir = args.workdir or REPO / "runs" / "experiments" / time.strftime("%Y%m%d-%H%M%S")
    plot_path = args.plot or workdir / "staleness_accuracy.png"
    analysis = {"reward_window": args.reward_window, "max_run_load": args.max_run_load}
    if args.from_json is not None:
        results, settings = load_results(args.from_json)
        report(results, settings, json_path=args.json, plot_path=plot_path, **analysis)
        return
    settings = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()}
    settings["cpu_count"] = os.cpu_count()
    started = time.monotonic()
    model, data = prepare_warm_start(args.cache_dir, workdir, sft_steps=args.sft_steps, timeout=args.run_timeout)
    cells = [Cell(s, c) for s in args.staleness for c in args.corrections]
    results: list[RunResult] = []
    for seed in args.seeds:
        for cell in cells:
            run_dir = workdir / f"s{cell.max_staleness}-{cell.correction}-seed{seed}"
            print(f"[{time.monotonic() - started:6.0f}s] {cell.label}, seed {seed} -> {run_dir}", flush=True)
            wait_for_quiet_machine(args.max_load, args.max_load_wait)
            result = run_one(
                cell,
                seed,
                model=model,
                data=data,
                run_dir=run_dir,
                num_rollout=args.num_rollout,
                eval_interval=args.eval_interval,
                rollout_workers=args.rollout_workers,
                decoupled_ppo=args.decoupled_ppo,
                timeout=args.run_timeout,
            )
            results.append(result)
            if result.ok:
                print(
                    f"         final accuracy {result.final_accuracy:.3f}, learner {result.wall_clock:.1f}s, "
                    f"process {result.process_seconds:.0f}s, load average {result.mean_load:.1f}",
                    flush=True,
                )
            else:
                print(f"         FAILED: {result.error}", flush=True)
    settings["total_seconds"] = round(time.monotonic() - started, 1)
    print(f"\nsweep took {settings['total_seconds']:.0f}s for {len(results)} runs")
    report(results, settings, json_path=args.json, plot_path=plot_path, **analysis)


if __name__ == "__main__":
    main()
