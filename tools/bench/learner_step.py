"""Benchmark: one learner step against a bare Hugging Face forward + backward + AdamW on the same batch, with the
peak memory of each, and the memory of computing log-probs with and without the fused output head.

    python -m tools.bench.learner_step                                   # the demo's tiny model and batch
    python -m tools.bench.learner_step --model smollm2 --prompts 8 --response-len 12 --lora-rank 16
    python -m tools.bench.learner_step --model qwen2.5-0.5b --prompts 1 --samples-per-prompt 2 --response-len 1024 \
        --lora-rank 16 --parts log-probs

The learner step is `actors.learner.step.TrainingStep.train` with the real torch trainer: conversion from bus
samples, reference log-probs when a KL term needs them, advantages, the loss with its importance weights and
metrics, packed micro-batches, clipping, AdamW, the version counter. It runs twice: with the fused output head
(the default: log-probs from hidden states a chunk at a time, `engines/training/output_head.py`) and with the plain
head (the whole [tokens x vocabulary] logits, as before the fused head). The baseline is what a hand-written loop
does with the same model and batch: right-padded `model(input_ids, attention_mask, labels)`, `loss.backward()`,
gradient clipping, `AdamW.step()` (over a PEFT adapter with `--lora-rank`), plus one no-grad forward of a reference
copy when the row has a KL term. The log-probs rows are `compute_log_probs` on the batch (the reference and pi_old
passes of a step), fused and plain.

Peak memory is the process's resident high-water mark during the measured calls above what it held before them
(Linux `/proc/self/clear_refs`), after a warm-up call created the optimizer state. The benchmark runs with glibc's
mmap threshold fixed at 64 KiB (`tools/bench/allocator.py`): by default glibc raises the threshold as large blocks
are freed, serves later ones from a heap it keeps resident, and a call whose tensors fit in what an earlier call left
behind then shows no peak at all. Rows are interleaved per repeat; the table reports
medians.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from tools.bench.allocator import fix_mmap_threshold

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Row:
    what: str
    threads: int
    ms: float
    peak_mb: float
    baseline: str
    baseline_ms: float
    baseline_peak_mb: float

    @property
    def ratio(self) -> float:
        return self.ms / self.baseline_ms


def demo_batch(tokenizer, prompts: int, samples_per_prompt: int, seed: int = 0) -> list:
    """Addition prompts with 1-3 digit answers and an end token: the demo's shapes, half of them rewarded."""
    rng = random.Random(seed)
    batch = []
    for group in range(prompts):
        a, b = rng.randint(0, 19), rng.randint(0, 19)
        prompt = tokenizer(f"{a}+{b}=")["input_ids"]
        for index in range(samples_per_prompt):
            response = tokenizer(str(a + b + rng.choice([0, 0, 1])))["input_ids"] + [tokenizer.eos_token_id]
            batch.append(_sample(group, index, prompt, response))
    return batch


def random_batch(vocab: int, prompts: int, samples_per_prompt: int, prompt_len: int, response_len: int,
                 seed: int = 0) -> list:
    """Random token ids: each group's prompt of `prompt_len`, responses of between half and all of `response_len`
    (so a padded batch pays for its longest row, as it does on real rollouts), half of them rewarded."""
    rng = random.Random(seed)
    batch = []
    for group in range(prompts):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        for index in range(samples_per_prompt):
            length = rng.randint(max(1, response_len // 2), response_len)
            batch.append(_sample(group, index, prompt, [rng.randrange(vocab) for _ in range(length)]))
    return batch


def _sample(group: int, index: int, prompt: list[int], response: list[int]):
    from bus.schema import Sample

    tokens = np.asarray(prompt + response, dtype=np.int32)
    return Sample(sample_id=f"g{group}/{index}", group_id=f"g{group}", index=index, prompt="",
                  prompt_tokens=len(prompt), tokens=tokens, response_length=len(response),
                  loss_mask=np.ones(len(response), dtype=np.float32),
                  rollout_log_probs=np.full(len(response), -0.5, dtype=np.float32),
                  token_versions=np.zeros(len(response), dtype=np.int32), reward=float(index % 2))


def run_config(model: Path, samples_per_prompt: int, kl: bool, lora_rank: int, fused: bool):
    from actors.config import build_config

    settings = {"hf_checkpoint": str(model), "n_samples_per_prompt": samples_per_prompt,
                "advantage_estimator": "grpo", "loss_agg_mode": "token-mean", "lr": 1e-4,
                "off_policy_correction": "tis", "micro_batch_tokens": 1 << 20, "fused_output_head": fused}
    if kl:
        settings.update({"use_kl_loss": True, "kl_loss_coef": 0.05, "kl_loss_type": "low_var_kl"})
    if lora_rank:
        settings.update({"lora_rank": lora_rank, "lora_alpha": 2 * lora_rank})
    return build_config(settings)


def ours(model: Path, samples: list, samples_per_prompt: int, kl: bool, lora_rank: int,
         fused: bool) -> tuple[Callable[[], None], Callable[[], None]]:
    """The learner's step, and its log-probs pass over the whole batch."""
    from actors.learner import stages
    from actors.learner.step import TrainingStep
    from actors.learner.trainer_factory import build_trainer

    config = run_config(model, samples_per_prompt, kl, lora_rank, fused)
    trainer = build_trainer(config)
    step = TrainingStep(trainer, config)
    staleness = [0] * len(samples)
    typed = stages.to_step_batch(samples, rewarded=False).samples
    return (lambda: step.train(samples, staleness),
            lambda: trainer.compute_log_probs(typed, temperature=1.0))


def bare(model: Path, samples: list, kl: bool, lora_rank: int, pad_id: int) -> Callable[[], None]:
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    if lora_rank:
        from peft import LoraConfig, get_peft_model

        policy = get_peft_model(policy, LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank,
                                                   target_modules="all-linear"))
    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval() if kl else None
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-4)
    width = max(len(s.tokens) for s in samples)
    ids = torch.full((len(samples), width), pad_id)
    mask = torch.zeros((len(samples), width), dtype=torch.long)
    labels = torch.full((len(samples), width), -100)
    for row, sample in enumerate(samples):
        length = len(sample.tokens)
        ids[row, :length] = torch.as_tensor(sample.tokens)
        mask[row, :length] = 1
        labels[row, length - sample.response_length:length] = torch.as_tensor(sample.tokens[-sample.response_length:])

    def step() -> None:
        if reference is not None:
            with torch.no_grad():
                reference(input_ids=ids, attention_mask=mask)
        optimizer.zero_grad(set_to_none=True)
        policy(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()

    return step


def measured(call: Callable[[], object], iterations: int) -> tuple[float, float]:
    """(ms per call, peak MB above the memory held before) over `iterations` calls."""
    before = _resident_mb()
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from now
    started = time.perf_counter()
    for _ in range(iterations):
        call()
    elapsed = (time.perf_counter() - started) / iterations * 1000
    return elapsed, _status_mb("VmHWM") - before


def _resident_mb() -> float:
    return _status_mb("VmRSS")


def _status_mb(field: str) -> float:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", text).group(1)) / 1024


def compare(runs: dict[str, Callable[[], object]], repeats: int, iterations: int) -> dict[str, tuple[float, float]]:
    """Median ms and median peak MB of each run, interleaved per repeat (alternating which goes first)."""
    for call in runs.values():
        call()  # warm-up: lazy initialisation and the optimizer state stay out of the figures
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for repeat in range(repeats):
        for name in list(runs) if repeat % 2 == 0 else list(reversed(runs)):
            figures[name].append(measured(runs[name], iterations))
    return {name: (statistics.median(ms for ms, _ in values), statistics.median(mb for _, mb in values))
            for name, values in figures.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="tiny, smollm2 or qwen2.5-0.5b (tools/bench/models.py)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples-per-prompt", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=48, help="random-token models: prompt tokens")
    parser.add_argument("--response-len", type=int, default=64, help="random-token models: longest response")
    parser.add_argument("--lora-rank", type=int, default=0, help="train a LoRA adapter of this rank (0: every weight)")
    parser.add_argument("--losses", nargs="+", choices=("grpo", "grpo-kl"), default=["grpo", "grpo-kl"])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--parts", nargs="+", choices=("step", "log-probs"), default=["step", "log-probs"],
                        help="which rows to measure: a 0.5B shape's step at 1k tokens takes minutes a call")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    fix_mmap_threshold()  # before any large allocation: see the docstring
    from actors.runtime.logs import quiet_library_output

    quiet_library_output()
    from transformers import AutoConfig, AutoTokenizer

    from tools.bench.models import bench_model

    model = bench_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    if args.model == "tiny":
        samples = demo_batch(tokenizer, args.prompts, args.samples_per_prompt)
    else:
        vocab = AutoConfig.from_pretrained(model).vocab_size
        samples = random_batch(vocab, args.prompts, args.samples_per_prompt, args.prompt_len, args.response_len)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rows: list[Row] = []
    for loss in args.losses:
        kl = loss == "grpo-kl"
        for threads in args.threads:
            torch.set_num_threads(threads)
            fused_step, fused_log_probs = ours(model, samples, args.samples_per_prompt, kl, args.lora_rank, True)
            plain_step, plain_log_probs = ours(model, samples, args.samples_per_prompt, kl, args.lora_rank, False)
            if "step" in args.parts:
                steps = compare({"fused": fused_step, "plain": plain_step,
                                 "bare": bare(model, samples, kl, args.lora_rank, pad_id)}, args.repeats,
                                args.iterations)
                name = "GRPO+TIS+KL" if kl else "GRPO+TIS"
                for label, key in (("step, fused head", "fused"), ("step, plain head", "plain")):
                    rows.append(Row(f"{name} {label}", threads, *steps[key], "bare HF step", *steps["bare"]))
            if not kl and "log-probs" in args.parts:
                passes = compare({"fused": fused_log_probs, "plain": plain_log_probs}, args.repeats, args.iterations)
                rows.append(Row("log-probs, fused head", threads, *passes["fused"], "plain head", *passes["plain"]))
    print_table(args, samples, rows)
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(row) | {"ratio": row.ratio} for row in rows], indent=2),
                             encoding="utf-8")


def print_table(args: argparse.Namespace, samples: list, rows: list[Row]) -> None:
    responses = sum(s.response_length for s in samples)
    training = f"LoRA rank {args.lora_rank}" if args.lora_rank else "every weight"
    print(f"model {args.model}, {len(samples)} samples, {sum(len(s.tokens) for s in samples)} tokens "
          f"({responses} response tokens), {training}; medians of {args.repeats} x {args.iterations} calls")
    print(f"{'what':<34} {'threads':>7} {'ms':>9} {'peak MB':>8}   {'baseline':<13} {'ms':>9} {'peak MB':>8} "
          f"{'time':>6} {'memory':>7}")
    for row in rows:
        memory = row.peak_mb / row.baseline_peak_mb if row.baseline_peak_mb > 0 else float("nan")
        print(f"{row.what:<34} {row.threads:>7} {row.ms:>9.1f} {row.peak_mb:>8.0f}   {row.baseline:<13} "
              f"{row.baseline_ms:>9.1f} {row.baseline_peak_mb:>8.0f} {row.ratio:>5.2f}x {memory:>6.2f}x")


if __name__ == "__main__":
    main()
