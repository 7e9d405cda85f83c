"""Staleness x off-policy-correction sweep: held-out accuracy against wall-clock, sync vs fully-async.

`python -m tools.experiments.staleness --seeds 1 2 --staleness 0 1 2 4 --corrections none tis --json out.json`

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
- Wall-clock is the learner's clock: seconds since the learner started (its "actor started" log event, just
  after it opened its metrics; `metrics/train.jsonl`'s `time` is the run's clock, which counts start-up too).
  Process start-up (the same for every cell) is left out of the ratios and kept in the JSON as `process_seconds`.
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
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from actors.runtime.metrics import read_metrics
from tools.demo import COMMON, GRPO, MAX_OPERAND, MODEL_SPEC, SFT, override_flags
from tools.evaluate import evaluate_model
from tools.experiments.staleness_results import (
    Cell,
    RunResult,
    learner_origin,
    load_results,
    read_reward_steps,
    report,
)
from tools.make_arithmetic_data import make_arithmetic_data
from tools.standins.tiny_model import cached_tiny_model

REPO = Path(__file__).resolve().parents[2]

EVAL_NAME = "heldout"
DATA_SETTINGS = {"max_operand": MAX_OPERAND, "eval_size": 80, "sft_size": 320, "seed": 0}
LOAD_SAMPLE_SECONDS = 2.0
QUICK = {
    "seeds": [1],
    "staleness": [0, 2],
    "corrections": ["tis"],
    "num_rollout": 6,
    "eval_interval": 3,
    "sft_steps": 0,
    "rollout_workers": 1,
    "rollout_batch_size": 8,  # the recipe's 32 prompts x 8 samples is most of a smoke run's time
}


# ------------------------------------------------------------------------------------------------ arguments
def grpo_arguments(
    cell: Cell,
    seed: int,
    *,
    num_rollout: int,
    eval_interval: int,
    rollout_workers: int,
    rollout_batch_size: int,
    decoupled_ppo: bool,
) -> list[str]:
    """The demo's GRPO recipe with this run's cell, seed and schedule swapped in: the same task everywhere."""
    per_run = {
        "--num-rollout": str(num_rollout),
        "--max-staleness": str(cell.max_staleness),
        "--off-policy-correction": cell.correction,
        "--eval-interval": str(eval_interval),
        "--rollout-workers": str(rollout_workers),
        "--rollout-batch-size": str(rollout_batch_size),
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
    rollout_batch_size: int,
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
            rollout_batch_size=rollout_batch_size,
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
    origin = learner_origin(run_dir)
    if origin is None:
        result.error = f"no 'actor started' event in {run_dir / 'logs' / 'learner.jsonl'}: no learner clock"
        return result
    result.wall_clock = float(train[-1]["wall"]) - origin
    stale = [r["staleness/mean"] for r in train if isinstance(r.get("staleness/mean"), (int, float))]
    result.mean_staleness = sum(stale) / len(stale) if stale else None
    result.reward_steps = read_reward_steps(train, origin)
    curve = [p for p in eval_curve(run_dir / "metrics", origin) if p[0] < int(train[-1]["version"])]
    # The last round is usually cut off by the run's stop; score the exported model instead, at the last step.
    final = asyncio.run(evaluate_model(final_model, data["eval"], max_new_tokens=4))["accuracy"]
    result.final_accuracy = final
    result.curve = [*curve, (int(train[-1]["version"]), result.wall_clock, final)]
    return result


# ------------------------------------------------------------------------------------------------ analysis
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
        "--rollout-batch-size",
        type=int,
        default=int(GRPO[GRPO.index("--rollout-batch-size") + 1]),
        help="prompts per learner step (the demo's recipe by default)",
    )
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
        "--quick",
        action="store_true",
        help="smoke run: 1 seed, staleness 0 and 2 with tis, 6 steps of 8 prompts, no warm start",
    )
    args = parser.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    if 0 not in args.staleness and args.from_json is None:
        parser.error("--staleness must include 0: the synchronous runs are the reference")
    if any(s < 0 for s in args.staleness) or args.sft_steps < 0:
        parser.error("--staleness values and --sft-steps must be >= 0")
    if min(args.num_rollout, args.eval_interval, args.reward_window, args.rollout_batch_size) < 1:
        parser.error("--num-rollout, --eval-interval, --reward-window and --rollout-batch-size must be >= 1")
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
                rollout_batch_size=args.rollout_batch_size,
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
