"""Do two synchronous runs with one --seed repeat bit for bit, and what do the deterministic flags cost?

The time-to-accuracy benchmark's synchronous run (`tools/bench/learning.py`: the demo's task from its SFT warm
start, 32 prompts x 8 samples a step, two rollout workers) is launched twice per mode with seed 0: with the
defaults (the baseline), with `--deterministic-inference` (batch-invariant engines), and with that and
`--deterministic-mode` (ordered kernels in the learner). For each pair the table shows the first step at which
the two runs differ in any bit: in what reads the engines' log-probs (mu: the PPO ratio's and KL diagnostics), in
the rewards (the samples), and in the loss or gradient norm; and each mode's median steps/s.

    python -m tools.bench.reproducibility                # 150 steps; about 7 minutes on 2 cores
    python -m tools.bench.reproducibility --quick        # 40 steps: too short to see the samples drift
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tools.bench.learning import Hyper, prepare, slipstream_command
from tools.repo_env import with_repo_on_path

REPO = Path(__file__).resolve().parents[2]

MODES = {"defaults": [], "--deterministic-inference": ["--deterministic-inference"],
         "both flags": ["--deterministic-inference", "--deterministic-mode"]}
# What a diverging run shows first: what reads mu (the engines' log-probs), the samples' rewards, the training.
COMPARED = {"mu": ("ppo_kl", "ratio_max", "ratio_min", "train_rollout_logprob_abs_diff"),
            "rewards": ("rollout/reward_mean",), "loss, grad norm": ("loss", "grad_norm")}


@dataclass(frozen=True)
class Pair:
    mode: str
    steps: int
    first_difference: dict[str, int | None]  # per row of COMPARED: the first step that differs, None if none did
    steps_per_s: float  # median over the two runs, steps after the first (start-up excluded)


def train_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics" / "train.jsonl").read_text().splitlines()]


def first_difference(first: list[dict], second: list[dict], keys: tuple[str, ...]) -> int | None:
    """The first step whose `keys` differ in any bit (a step one run lacks counts as a difference)."""
    for step in range(max(len(first), len(second))):
        if step >= len(first) or step >= len(second):
            return step + 1
        if any(first[step].get(key) != second[step].get(key) for key in keys):
            return step + 1
    return None


def steps_per_second(rows: list[dict]) -> float:
    if len(rows) < 3:
        return float("nan")
    return (len(rows) - 1) / (rows[-1]["wall"] - rows[0]["wall"])


def run_pair(mode: str, extra: list[str], hyper: Hyper, warm: Path, data: dict[str, Path], workdir: Path) -> Pair:
    runs = []
    for attempt in ("a", "b"):
        run_dir = workdir / f"{mode.strip('-').replace(' ', '_')}_{attempt}"
        shutil.rmtree(run_dir, ignore_errors=True)  # a run directory left over would be resumed
        command = slipstream_command("sync", hyper, warm, data, run_dir, seed=0, snapshot_every=hyper.steps,
                                     extra=["--final-eval-timeout", "0", "--no-progress", "--no-plots", *extra])
        started = time.monotonic()
        print(f"{mode}, run {attempt}: {hyper.steps} synchronous steps", flush=True)
        subprocess.run(command, cwd=REPO, check=True, env=with_repo_on_path())
        print(f"  {time.monotonic() - started:.0f} s", flush=True)
        runs.append(train_rows(run_dir))
    differences = {name: first_difference(runs[0], runs[1], keys) for name, keys in COMPARED.items()}
    return Pair(mode, hyper.steps, differences, statistics.median(steps_per_second(rows) for rows in runs))


def table(pairs: list[Pair]) -> str:
    header = ["mode", "steps", *(f"first step {name} differ" for name in COMPARED), "steps/s"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for pair in pairs:
        cells = [pair.mode, str(pair.steps),
                 *("none" if step is None else str(step) for step in pair.first_difference.values()),
                 f"{pair.steps_per_s:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    baseline, deterministic = pairs[0].steps_per_s, pairs[-1].steps_per_s
    lines.append(f"\n{pairs[-1].mode} run at {deterministic / baseline:.2f}x the defaults' steps/s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--quick", action="store_true", help="40 steps: the smoke run")
    parser.add_argument("--workdir", type=Path, default=REPO / "runs" / "bench_reproducibility")
    parser.add_argument("--json", type=Path, default=None, help="also write the pairs here")
    args = parser.parse_args(argv)
    hyper = Hyper(steps=40 if args.quick else args.steps)
    warm, data = prepare(args.workdir)
    pairs = [run_pair(mode, extra, hyper, warm, data, args.workdir) for mode, extra in MODES.items()]
    print(table(pairs))
    if args.json is not None:
        args.json.write_text(json.dumps([pair.__dict__ for pair in pairs], indent=2))


if __name__ == "__main__":
    main()
