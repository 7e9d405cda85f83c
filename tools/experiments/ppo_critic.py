"""PPO with a critic on the demo's task and model: held-out accuracy before and after, the critic's explained
variance step by step, and the learner killed with SIGKILL mid-run to show the resume.

    python -m tools.experiments.ppo_critic [--workdir runs/ppo-critic] [--steps 24] [--kill-at 10]

SmolLM2-135M-Instruct, sums of a two-digit and a one-digit number, the demo's fully-async settings (LoRA rank 16 on
the policy) with `--advantage-estimator ppo`: a value model (the full 135M model with a 1-wide head, its own
learning rate) trained beside the policy, GAE over its values (gamma 1, lambda 0.95), whitened advantages, two
critic-only warm-up batches. Held-out accuracy comes from the run's own eval rounds (greedy, 100 pairs never
trained on, before training and every 4 steps). With `--kill-at N` the learner process is killed once step N is
logged; the launcher restarts it and it resumes from its latest checkpoint (every 4 steps), critic included.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from actors.runtime.logs import quiet_library_output
from actors.runtime.metrics import read_metrics
from tools.demo import REPO, SMOLLM2_EVAL_PROMPTS, SMOLLM2_GRPO, override_flags
from tools.make_arithmetic_data import make_sum_questions, write_jsonl

CRITIC_LR = "1e-4"
PPO = {"--advantage-estimator": "ppo", "--lambd": "0.95", "--normalize-advantages": "",
       "--num-critic-only-steps": "2", "--critic-lr": CRITIC_LR, "--save-interval": "4"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=REPO / "runs" / "ppo-critic")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--kill-at", type=int, default=10, help="kill the learner after this step (0: never)")
    parser.add_argument("--critic-lr", default=CRITIC_LR, help="the value model's learning rate")
    parser.add_argument("--products-share", type=float, default=0.0,
                        help="share of the training prompts replaced by two-digit products, which SmolLM2 almost "
                             "never gets right: a value the question itself predicts, for a critic to learn (the "
                             "held-out set stays sums)")
    args = parser.parse_args()
    quiet_library_output()
    from engines.pretrained import SMOLLM2, cached_pretrained

    model = cached_pretrained(SMOLLM2, REPO / ".cache")
    data = make_sum_questions(args.workdir / "data", eval_size=SMOLLM2_EVAL_PROMPTS)
    if args.products_share > 0:
        data["train"] = mix_in_products(data["train"], args.products_share)
    run_dir = args.workdir / time.strftime("%Y%m%d-%H%M%S")
    flags = override_flags(SMOLLM2_GRPO, {**PPO, "--num-rollout": str(args.steps), "--critic-lr": args.critic_lr})
    command = [sys.executable, "launcher.py", "--head", "--run-dir", str(run_dir), "--hf-checkpoint", str(model),
               "--prompt-data", str(data["train"]), "--eval-prompt-data", "heldout", str(data["eval"]), *flags,
               "--lora-rank", "16", "--lora-alpha", "32"]
    print("$ python " + " ".join(command[1:]), flush=True)
    started = time.monotonic()
    run = subprocess.Popen(command, cwd=REPO)
    killed = kill_learner_after(run, run_dir, args.kill_at) if args.kill_at else None
    if run.wait() != 0:
        raise SystemExit(f"ppo_critic: the run exited with {run.returncode}; see {run_dir / 'logs'}")
    report(run_dir, time.monotonic() - started, killed)


def mix_in_products(train: Path, share: float, seed: int = 0) -> Path:
    """`train` with `share` of its prompts (a seeded choice) replaced by two-digit products, written beside it."""
    sums = [json.loads(line) for line in train.read_text(encoding="utf-8").splitlines()]
    generator = random.Random(seed)
    count = round(share * len(sums))
    products = [{"input": f"What is {a} * {b}? Answer with just the number.", "label": str(a * b)}
                for a, b in ((generator.randrange(11, 100), generator.randrange(11, 100)) for _ in range(count))]
    mixed = generator.sample(sums, len(sums) - count) + products
    generator.shuffle(mixed)
    path = train.with_name(f"train-products-{share:g}.jsonl")
    write_jsonl(path, mixed)
    return path


def kill_learner_after(run: subprocess.Popen, run_dir: Path, step: int) -> int | None:
    """SIGKILL the learner process once `step` is in train.jsonl; returns the step it was killed after."""
    train = run_dir / "metrics" / "train.jsonl"
    while run.poll() is None:
        done = [row["step"] for row in read_metrics(train)] if train.exists() else []
        if done and max(done) >= step:
            started = [json.loads(line)["pid"] for line in (run_dir / "logs" / "launcher-0.jsonl").read_text()
                       .splitlines() if '"actor": "learner"' in line and "actor process started" in line]
            os.kill(started[-1], signal.SIGKILL)
            print(f"[ppo_critic] killed the learner (pid {started[-1]}) after step {max(done)}", flush=True)
            return max(done)
        time.sleep(0.5)
    return None


def report(run_dir: Path, seconds: float, killed: int | None) -> None:
    rounds = [row for row in read_metrics(run_dir / "metrics" / "eval.jsonl") if "eval/heldout/reward/correct" in row]
    steps = {row["step"]: row for row in read_metrics(run_dir / "metrics" / "train.jsonl")}
    explained = [(step, steps[step].get("critic/explained_variance")) for step in sorted(steps)]
    resumed = (run_dir / "logs" / "learner.jsonl").read_text().count("resumed from checkpoint")
    result = {"held_out": [(row["step"], row["eval/heldout/reward/correct"]) for row in rounds],
              "explained_variance": explained, "killed_after_step": killed, "resumes": resumed,
              "seconds": seconds}
    (run_dir / "ppo_critic.json").write_text(json.dumps(result, indent=2), encoding="utf-8")
    print("\n" + "=" * 80)
    print(f"PPO with a critic, SmolLM2-135M-Instruct, {SMOLLM2_EVAL_PROMPTS} held-out sums (greedy)")
    print("  held-out accuracy by step: " + ", ".join(f"{step}: {value:.0%}" for step, value in result["held_out"]))
    shown = ", ".join(f"{step}: {value:.2f}" for step, value in explained if value is not None)
    print(f"  critic explained variance by step: {shown}")
    values = [value for _, value in explained if value is not None]
    if len(values) >= 11:
        print(f"  explained variance, median of the first 3: {statistics.median(values[:3]):.2f}, "
              f"of the last 8: {statistics.median(values[-8:]):.2f}")
    print(f"  learner killed after step {killed}, resumed {resumed} time(s); {seconds:.0f}s; {run_dir}")
    print("=" * 80)


if __name__ == "__main__":
    main()
