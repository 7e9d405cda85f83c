"""Benchmark: one learner step against a bare Hugging Face forward + backward + AdamW on the same batch.

    python tools/bench_learner_step.py                 # the demo's batch (32 prompts x 8), 1 and 2 threads
    python tools/bench_learner_step.py --json out.json

The learner step is `actors.learner.step.TrainingStep.train` with the real torch trainer: conversion from bus
samples, reference log-probs when a KL term needs them, advantages, the loss with its importance weights and
metrics, packed micro-batches, clipping, AdamW, the version counter. The baseline is what a hand-written loop
does with the same model and batch: right-padded `model(input_ids, attention_mask, labels)`, `loss.backward()`,
gradient clipping, `AdamW.step()`, plus one no-grad forward of a reference copy when the row has a KL term.
Rows are interleaved per repeat; the table reports medians. The issue's target: the learner step at most 1.05x
the baseline.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent


def demo_batch(tokenizer, prompts: int, samples_per_prompt: int, seed: int = 0) -> list:
    """Addition prompts with 1-3 digit answers and an end token: the demo's shapes, half of them rewarded."""
    from bus.schema import Sample

    rng = random.Random(seed)
    batch = []
    for group in range(prompts):
        a, b = rng.randint(0, 19), rng.randint(0, 19)
        prompt = tokenizer(f"{a}+{b}=")["input_ids"]
        for index in range(samples_per_prompt):
            response = tokenizer(str(a + b + rng.choice([0, 0, 1])))["input_ids"] + [tokenizer.eos_token_id]
            tokens = np.asarray(prompt + response, dtype=np.int32)
            batch.append(Sample(sample_id=f"g{group}/{index}", group_id=f"g{group}", index=index, prompt="",
                                prompt_tokens=len(prompt), tokens=tokens, response_length=len(response),
                                loss_mask=np.ones(len(response), dtype=np.float32),
                                rollout_log_probs=np.full(len(response), -0.5, dtype=np.float32),
                                token_versions=np.zeros(len(response), dtype=np.int32), reward=float(index % 2)))
    return batch


def ours(model: Path, samples: list, kl: bool) -> Callable[[], None]:
    from actors.config import build_config
    from actors.learner.step import TrainingStep
    from actors.learner.trainer_factory import build_trainer

    settings = {"hf_checkpoint": str(model), "n_samples_per_prompt": 8, "advantage_estimator": "grpo",
                "loss_agg_mode": "token-mean", "lr": 1e-4, "off_policy_correction": "tis"}
    if kl:
        settings.update({"use_kl_loss": True, "kl_loss_coef": 0.05, "kl_loss_type": "low_var_kl"})
    config = build_config(settings)
    step = TrainingStep(build_trainer(config), config)
    staleness = [0] * len(samples)
    return lambda: step.train(samples, staleness)


def bare(model: Path, samples: list, kl: bool, pad_id: int) -> Callable[[], None]:
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval() if kl else None
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-4)
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


def timed(step: Callable[[], None], iterations: int) -> float:
    started = time.perf_counter()
    for _ in range(iterations):
        step()
    return (time.perf_counter() - started) / iterations * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from engines.tiny_model import cached_tiny_model
    from tools.demo import MODEL_SPEC

    hf_logging.disable_progress_bar()
    model = cached_tiny_model(REPO / ".cache" / "models", MODEL_SPEC)
    tokenizer = AutoTokenizer.from_pretrained(model)
    samples = demo_batch(tokenizer, prompts=32, samples_per_prompt=8)
    rows = []
    for kl in (False, True):
        for threads in args.threads:
            torch.set_num_threads(threads)
            runs = {"slipstream": ours(model, samples, kl),
                    "bare HF": bare(model, samples, kl, tokenizer.pad_token_id)}
            for step in runs.values():
                step()  # warm-up
            times: dict[str, list[float]] = {name: [] for name in runs}
            for repeat in range(args.repeats):
                order = list(runs) if repeat % 2 == 0 else list(reversed(runs))
                for name in order:
                    times[name].append(timed(runs[name], args.iterations))
            medians = {name: statistics.median(values) for name, values in times.items()}
            rows.append({"kl": kl, "threads": threads, "slipstream_ms": medians["slipstream"],
                         "bare_hf_ms": medians["bare HF"], "ratio": medians["slipstream"] / medians["bare HF"]})
    print(f"learner step on {len(samples)} samples ({sum(len(s.tokens) for s in samples)} tokens), medians of "
          f"{args.repeats} x {args.iterations} steps; target ratio <= 1.05")
    print(f"{'loss':<16} {'threads':>7} {'slipstream ms':>13} {'bare HF ms':>10} {'ratio':>6}")
    for row in rows:
        name = "GRPO+TIS+KL" if row["kl"] else "GRPO+TIS"
        print(f"{name:<16} {row['threads']:>7} {row['slipstream_ms']:>13.1f} {row['bare_hf_ms']:>10.1f} "
              f"{row['ratio']:>6.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()
