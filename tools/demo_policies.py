"""Two SmolLM2 policies co-trained in one run on shared engines, against the same two runs one after the other.

`python -m tools.demo_policies`: two LoRA adapters of SmolLM2-135M-Instruct,
each with its own task and held-out set, trained by fully-async GRPO in one run. Each is a policy
(docs/multi-policy.md): its own buffer, learner and versions, and both generate on the same rollout workers' engines,
which serve the two adapters by name and batch their rows together. `--sequential` also runs each policy alone,
with the same settings, one after the other, and prints the table: each policy's held-out accuracy before and after,
and the samples trained per second of both setups.

- sums: "What is 47 + 8?", the main demo's task (`python -m tools.demo`);
- two_digit: "What is 47 + 38?", two-digit sums with a carry into the tens.
"""

from __future__ import annotations

import argparse
import os
import resource
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from actors.runtime.logs import quiet_library_output
from actors.runtime.metrics import read_metrics
from tools.demo import SMOLLM2_EVAL_PROMPTS, SMOLLM2_GRPO, override_flags
from tools.make_arithmetic_data import make_sum_questions, make_two_digit_sum_questions

REPO = Path(__file__).resolve().parent.parent
TASKS = {"sums": make_sum_questions, "two_digit": make_two_digit_sum_questions}
RANK = 16
# The main demo's recipe for each policy (tools/demo.py: SMOLLM2_GRPO), as a LoRA run of rank 16.
RECIPE = [*override_flags(SMOLLM2_GRPO, {"--eval-interval": "8"}), "--lora-rank", str(RANK), "--lora-alpha",
          str(2 * RANK)]


@dataclass(frozen=True)
class Outcome:
    """One policy's result in one run: held-out accuracy before and after, and the samples it trained."""

    before: float
    after: float
    steps: int
    samples: int


def policy_outcome(run_dir: Path) -> Outcome:
    """What a policy's directory (or a one-policy run's) holds: its eval rounds and its trained steps."""
    rounds = [row for row in read_metrics(run_dir / "metrics" / "eval.jsonl") if "eval/heldout/reward/correct" in row]
    if len(rounds) < 2:
        raise SystemExit(f"demo: {run_dir} holds {len(rounds)} held-out eval round(s); see {run_dir / 'logs'}")
    steps = [row for row in read_metrics(run_dir / "metrics" / "train.jsonl") if "step" in row]
    return Outcome(rounds[0]["eval/heldout/reward/correct"], rounds[-1]["eval/heldout/reward/correct"],
                   steps[-1]["step"], int(sum(row.get("rollout/samples", 0) for row in steps)))


@dataclass
class Spent:
    """What a launcher run took: seconds from launch to exit, and the CPU seconds (user + system) of every process it
    started. Their ratio is how many cores were busy: on this 2-core machine a setup that already keeps both cores
    busy cannot go faster by sharing engines, whatever it saves on a GPU."""

    seconds: float = 0.0
    cpu_seconds: float = 0.0

    def __add__(self, other: Spent) -> Spent:
        return Spent(self.seconds + other.seconds, self.cpu_seconds + other.cpu_seconds)


def run_launcher(arguments: list[str]) -> Spent:
    command = [sys.executable, "launcher.py", *arguments]
    print(f"\n$ {shlex.join(['python', *command[1:]])}", flush=True)
    started, before = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    if subprocess.run(command, cwd=REPO, check=False).returncode != 0:
        raise SystemExit("demo: the launcher failed (its message is above)")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the launcher's, and its actors' (each waited for)
    return Spent(time.monotonic() - started,
                 after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=REPO / "runs" / "demo-policies")
    parser.add_argument("--sequential", action="store_true",
                        help="also run each policy alone, one after the other, and compare samples per second")
    parser.add_argument("--num-rollout", type=int, default=16, help="steps of each policy")
    args = parser.parse_args()
    quiet_library_output()
    from engines.pretrained import SMOLLM2, ModelUnavailable, cached_pretrained

    try:
        model = cached_pretrained(SMOLLM2, REPO / ".cache")
    except ModelUnavailable as error:
        raise SystemExit(f"demo: {error}") from None
    data = {name: make(args.workdir / f"data-{name}", eval_size=SMOLLM2_EVAL_PROMPTS) for name, make in TASKS.items()}
    recipe = override_flags(RECIPE, {"--num-rollout": str(args.num_rollout)})
    stamp = time.strftime("%Y%m%d-%H%M%S")

    shared_dir = args.workdir / f"{stamp}-shared"
    shared_dir.mkdir(parents=True, exist_ok=True)
    settings = {"policies": {name: {"prompt_data": str(paths["train"]),
                                    "eval_prompt_data": ["heldout", str(paths["eval"])]}
                             for name, paths in data.items()}}
    (shared_dir / "policies.yaml").write_text(yaml.safe_dump(settings, sort_keys=False), encoding="utf-8")
    shared_spent = run_launcher(["--head", "--run-dir", str(shared_dir), "--hf-checkpoint", str(model),
                                   "--config", str(shared_dir / "policies.yaml"), *recipe])
    shared = {name: policy_outcome(shared_dir / "policies" / name) for name in TASKS}

    alone: dict[str, Outcome] = {}
    alone_spent = Spent()
    if args.sequential:
        for name, paths in data.items():
            run_dir = args.workdir / f"{stamp}-alone-{name}"
            alone_spent += run_launcher(["--head", "--run-dir", str(run_dir), "--hf-checkpoint", str(model),
                                           "--prompt-data", str(paths["train"]), "--eval-prompt-data", "heldout",
                                           str(paths["eval"]), *recipe])
            alone[name] = policy_outcome(run_dir)
    print_table(shared, shared_spent, alone, alone_spent)


def print_table(shared: dict[str, Outcome], shared_spent: Spent, alone: dict[str, Outcome],
                alone_spent: Spent) -> None:
    print("\n" + "=" * 104)
    print(f"held-out accuracy (greedy, {SMOLLM2_EVAL_PROMPTS} prompts per task never trained on), "
          "SmolLM2-135M-Instruct")
    print(f"{'setup':<34}" + "".join(f"{name + ' before -> after':>26}" for name in TASKS)
          + f"{'samples/s':>11}{'CPU s/sample':>14}{'cores busy':>12}")
    rows = [("two policies, shared engines", shared, shared_spent)]
    if alone:
        rows.append(("each alone, one after the other", alone, alone_spent))
    for label, outcomes, spent in rows:
        cells = "".join(f"{f'{o.before:.0%} -> {o.after:.0%} ({o.steps} steps)':>26}" for o in outcomes.values())
        samples = sum(o.samples for o in outcomes.values())
        print(f"{label:<34}{cells}{samples / spent.seconds:>11.2f}{spent.cpu_seconds / samples:>14.3f}"
              f"{spent.cpu_seconds / spent.seconds:>12.2f}")
    if alone:
        speedup = (sum(o.samples for o in shared.values()) / shared_spent.seconds) / (
            sum(o.samples for o in alone.values()) / alone_spent.seconds)
        print(f"shared engines: {speedup:.2f}x the samples per second ({shared_spent.seconds:.0f} s against "
              f"{alone_spent.seconds:.0f} s, launch to exit), on {os.cpu_count()} cores")
    print("=" * 104)


if __name__ == "__main__":
    main()
