"""The CPU demo (`make demo`): a tiny model gets better at addition through fully-async RL, on two cores.

1. Build (once, cached) a tiny Qwen2-style model and a character tokenizer, and the task data: integer
   addition with held-out operand pairs.
2. Warm-start it briefly with SFT, run through the same system (`launcher.py --loss-type sft`).
3. Fully-async GRPO with TIS (`--max-staleness 2`): 2 rollout workers, 1 reward worker, buffer, learner.
4. Print held-out accuracy (greedy) before and after RL, plus where the run's plots and metrics are.

Every step is an ordinary command printed before it runs, so the demo doubles as a worked example of the flags.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import subprocess
import sys
import time
from pathlib import Path

from engines.tiny_model import TinyModelSpec, cached_tiny_model
from tools.evaluate import evaluate_model
from tools.make_arithmetic_data import make_arithmetic_data

REPO = Path(__file__).resolve().parent.parent
MODEL_SPEC = TinyModelSpec(family="qwen2", hidden_size=128, intermediate_size=352, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, seed=0)
MAX_OPERAND = 19

COMMON = ["--rollout-max-response-len", "4", "--rollout-stop", "</s>", "--torch-threads", "1",
          "--console-log-level", "warning", "--no-use-tensorboard"]
# Measured (tuning runs from one 56% warm start, TIS active): 8 groups of 8 per RL step gained 7.5 points in 500
# steps, 16 groups 12.5, 32 groups 22.5 in 400 steps; lr 5e-4 and 1e-3 collapsed the policy. Two things keep the
# +20 bar from being reliable: this SFT warm start lands anywhere between 25% and 56% from run to run, and RL at
# lr 3e-4 helps a mid start but degraded both a weak one (26-30%) and a strong cosine-decayed one (71% -> 24%).
SFT = ["--loss-type", "sft", "--loss-agg-mode", "token-mean", "--n-samples-per-prompt", "1",
       "--rollout-batch-size", "32", "--num-rollout", "350", "--lr", "2e-3", "--max-staleness", "4",
       "--rm-type", "exact_match", "--rollout-workers", "1", "--reward-workers", "1"]
GRPO = ["--advantage-estimator", "grpo", "--loss-agg-mode", "token-mean", "--n-samples-per-prompt", "8",
        "--rollout-batch-size", "32", "--num-rollout", "400", "--lr", "3e-4", "--max-staleness", "2",
        "--off-policy-correction", "tis", "--rm-type", "exact_match", "--rollout-temperature", "1.0",
        "--rollout-workers", "2", "--reward-workers", "1", "--eval-interval", "100",
        "--n-samples-per-eval-prompt", "1"]


def run_launcher(arguments: list[str]) -> None:
    command = [sys.executable, "launcher.py", *arguments]
    print(f"\n$ {shlex.join(['python', *command[1:]])}", flush=True)
    started = time.monotonic()
    completed = subprocess.run(command, cwd=REPO, check=False)
    if completed.returncode != 0:
        raise SystemExit(f"demo: launcher exited with {completed.returncode}")
    print(f"(took {time.monotonic() - started:.0f}s)", flush=True)


def accuracy(model: Path, data: Path) -> float:
    return asyncio.run(evaluate_model(model, data, max_new_tokens=4))["accuracy"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=REPO / "runs" / "demo")
    args = parser.parse_args()
    started = time.monotonic()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    model = cached_tiny_model(REPO / ".cache" / "models", MODEL_SPEC)
    data = make_arithmetic_data(args.workdir / "data", max_operand=MAX_OPERAND, eval_size=80, sft_size=320)
    print(f"model: {model}\ndata: {data['train'].parent}", flush=True)

    sft_dir = args.workdir / f"{stamp}-sft"
    run_launcher(["--head", "--run-dir", str(sft_dir), "--hf-checkpoint", str(model), "--prompt-data",
                  str(data["sft"]), *COMMON, *SFT])
    warm = sft_dir / "final_model"
    before = accuracy(warm, data["eval"])
    print(f"\nheld-out accuracy after the SFT warm start: {before:.1%}", flush=True)

    rl_dir = args.workdir / f"{stamp}-grpo"
    run_launcher(["--head", "--run-dir", str(rl_dir), "--hf-checkpoint", str(warm), "--prompt-data",
                  str(data["train"]), "--eval-prompt-data", "heldout", str(data["eval"]), *COMMON, *GRPO])
    after = accuracy(rl_dir / "final_model", data["eval"])

    print("\n" + "=" * 72)
    print(f"held-out accuracy (greedy, {MAX_OPERAND}+{MAX_OPERAND} addition, pairs never trained on)")
    print(f"  before RL (after SFT warm start): {before:6.1%}")
    print(f"  after fully-async GRPO:           {after:6.1%}   ({100 * (after - before):+.1f} points)")
    print(f"  total demo time: {time.monotonic() - started:.0f}s")
    print(f"  plots: {rl_dir / 'plots'}   metrics: {rl_dir / 'metrics'}")
    print("=" * 72)


if __name__ == "__main__":
    main()
