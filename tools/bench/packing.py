"""Benchmark: sequence packing against naive padding, on heavy-tailed sequence lengths.

    python -m tools.bench.packing               # 64 samples, lognormal lengths, 4k-token budget, 3 repeats
    python -m tools.bench.packing --workload short --padded-batch 256   # the CPU demo's RL batch
    python -m tools.bench.packing --quick       # a few samples on a tiny model, for the smoke test
    python -m tools.bench.packing --json out.json

Two tables. Padding: the share of computed token slots that are padding. Packed rows carry none; the second
packed figure is what a fixed-shape backend would pad if every micro-batch were padded to the longest one, so
it also measures how evenly the planner spreads tokens over the fewest micro-batches that fit the budget.
The baseline pads each micro-batch of `--padded-batch` samples (arrival order) to its longest sample, and the
whole batch to its longest. Throughput: real tokens per second of forward+backward through the trainer's
packed path (with `packed_sdpa` and with transformers' sdpa block mask) against padded micro-batches with an
attention mask; the three alternate within each repeat and medians are shown.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engines.training.attention import register_packed_attention
from engines.training.base import TrainSample
from engines.training.logprobs import token_log_probs
from engines.training.micro_batches import forward_packed, pack_inputs, padded_fraction, plan_micro_batches
from tools.standins.tiny_model import TinyModelSpec, build_tiny_model, build_tokenizer


@dataclass(frozen=True)
class Workload:
    samples: int
    log_mean: float
    log_sigma: float
    max_length: int
    budget: int
    model: TinyModelSpec


FULL = Workload(
    samples=64,
    log_mean=5.0,
    log_sigma=0.9,
    max_length=2048,
    budget=4096,
    model=TinyModelSpec(
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    ),
)
# The CPU demo's RL batch: 32 groups x 8 samples of 5-11 tokens (a prompt like "12+7=" and a short answer).
SHORT = Workload(
    samples=256,
    log_mean=1.6,
    log_sigma=0.3,
    max_length=12,
    budget=8192,
    model=TinyModelSpec(
        hidden_size=128, intermediate_size=352, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2
    ),
)
QUICK = Workload(samples=8, log_mean=3.0, log_sigma=0.8, max_length=128, budget=256, model=TinyModelSpec())


@dataclass(frozen=True)
class PaddingRow:
    scheme: str
    micro_batches: int
    computed_tokens: int
    padded_fraction: float


@dataclass(frozen=True)
class SpeedRow:
    scheme: str
    seconds: float
    tokens_per_second: float
    speedup: float


def main() -> None:
    args = _parse_args()
    workload = QUICK if args.quick else {"long": FULL, "short": SHORT}[args.workload]
    repeats = 1 if args.quick else args.repeats
    samples = make_samples(workload, seed=args.seed)
    lengths = [int(s.tokens.numel()) for s in samples]
    print(
        f"{len(samples)} samples, {sum(lengths)} tokens, lengths median {int(statistics.median(lengths))} / "
        f"max {max(lengths)} (lognormal); budget {workload.budget} tokens; padded micro-batch {args.padded_batch}"
    )
    padding = _padding_rows(lengths, workload.budget, args.padded_batch)
    speed = _speed_rows(samples, workload, args.padded_batch, repeats, warm_up=not args.quick)
    _print_padding(padding)
    _print_speed(speed, repeats)
    if args.json:
        figures = {
            "padding": [asdict(r) for r in padding],
            "speed": [asdict(r) for r in speed],
            "tokens": sum(lengths),
        }
        Path(args.json).write_text(json.dumps(figures, indent=2))


def make_samples(workload: Workload, seed: int) -> list[TrainSample]:
    """Lognormal lengths (a long tail, as RL responses have), responses 30-90% of each sample."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(workload.samples):
        length = min(workload.max_length, 2 + int(rng.lognormvariate(workload.log_mean, workload.log_sigma)))
        response = max(1, int(length * rng.uniform(0.3, 0.9)))
        samples.append(TrainSample(torch.randint(6, 100, (length,), generator=generator), min(response, length - 1)))
    return samples


def _padded_groups(count: int, per_group: int) -> list[list[int]]:
    return [list(range(start, min(start + per_group, count))) for start in range(0, count, per_group)]


def _padding_rows(lengths: list[int], budget: int, per_group: int) -> list[PaddingRow]:
    plan = plan_micro_batches(lengths, budget)
    groups = _padded_groups(len(lengths), per_group)
    grouped = sum(len(g) * max(lengths[i] for i in g) for g in groups)
    whole = len(lengths) * max(lengths)
    total = sum(lengths)
    grid = len(plan) * max(sum(lengths[i] for i in members) for members in plan)
    return [
        PaddingRow("packed rows", len(plan), total, 0.0),
        PaddingRow("packed rows as a fixed-shape grid", len(plan), grid, padded_fraction(lengths, plan)),
        PaddingRow(f"padded to longest, {per_group}/micro-batch", len(groups), grouped, 1 - total / grouped),
        PaddingRow("padded to longest, whole batch", 1, whole, 1 - total / whole),
    ]


def _speed_rows(
    samples: list[TrainSample], workload: Workload, per_group: int, repeats: int, *, warm_up: bool
) -> list[SpeedRow]:
    register_packed_attention()
    model = build_tiny_model(workload.model, build_tokenizer())
    model.config.use_cache = False
    plan = plan_micro_batches([int(s.tokens.numel()) for s in samples], workload.budget)
    groups = _padded_groups(len(samples), per_group)
    schemes: dict[str, Callable[[], None]] = {
        "packed, packed_sdpa": lambda: _packed_pass(model, samples, plan, "packed_sdpa"),
        "packed, sdpa block mask": lambda: _packed_pass(model, samples, plan, "sdpa"),
        f"padded, {per_group}/micro-batch": lambda: _padded_pass(model, samples, groups),
    }
    for run in schemes.values() if warm_up else ():  # lazy initialisation and allocator growth are not throughput
        run()
    timings: dict[str, list[float]] = {name: [] for name in schemes}
    for repeat in range(repeats):
        order = list(schemes) if repeat % 2 == 0 else list(reversed(schemes))
        for name in order:
            started = time.perf_counter()
            schemes[name]()
            timings[name].append(time.perf_counter() - started)
    tokens = sum(int(s.tokens.numel()) for s in samples)
    baseline = statistics.median(timings[f"padded, {per_group}/micro-batch"])
    rows = []
    for name, seconds in timings.items():
        median = statistics.median(seconds)
        rows.append(SpeedRow(name, median, tokens / median, baseline / median))
    return rows


def _packed_pass(model: torch.nn.Module, samples: list[TrainSample], plan: list[list[int]], attention: str) -> None:
    model.config._attn_implementation = attention
    for members in plan:
        inputs = pack_inputs([samples[i] for i in members])
        outputs = token_log_probs(forward_packed(model, inputs), inputs.targets, temperature=1.0, with_entropy=False)
        (-outputs.log_probs.sum()).backward()
    model.zero_grad(set_to_none=True)


def _padded_pass(model: torch.nn.Module, samples: list[TrainSample], groups: list[list[int]]) -> None:
    """What a trainer without packing does: right-pad each micro-batch, mask the padding, score every row."""
    model.config._attn_implementation = "sdpa"
    for group in groups:
        chunk = [samples[i] for i in group]
        width = max(int(s.tokens.numel()) for s in chunk)
        input_ids = torch.zeros(len(chunk), width, dtype=torch.long)
        attention_mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for row, sample in enumerate(chunk):
            input_ids[row, : sample.tokens.numel()] = sample.tokens
            attention_mask[row, : sample.tokens.numel()] = 1
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        loss = 0.0
        for row, sample in enumerate(chunk):
            end = int(sample.tokens.numel())
            rows = log_probs[row, end - 1 - sample.response_length : end - 1]
            loss = loss - rows.gather(-1, sample.tokens[-sample.response_length :, None]).sum()
        loss.backward()
    model.zero_grad(set_to_none=True)


def _print_padding(rows: list[PaddingRow]) -> None:
    print(f"\n{'scheme':<40}{'micro-batches':>14}{'token slots':>13}{'padded':>9}")
    print("-" * 76)
    for r in rows:
        print(f"{r.scheme:<40}{r.micro_batches:>14}{r.computed_tokens:>13}{r.padded_fraction:>9.1%}")
    print("target: packed <= 5% (as a grid)")


def _print_speed(rows: list[SpeedRow], repeats: int) -> None:
    print(f"\n{'forward+backward':<40}{'seconds':>10}{'tokens/s':>12}{'vs padded':>11}   (median of {repeats})")
    print("-" * 73)
    for r in rows:
        print(f"{r.scheme:<40}{r.seconds:>10.2f}{r.tokens_per_second:>12.0f}{r.speedup:>10.2f}x")


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few samples on a tiny model: a smoke run")
    parser.add_argument(
        "--workload",
        choices=["long", "short"],
        default="long",
        help="long: 64 heavy-tailed samples up to 2k tokens; short: the CPU demo's 256 samples of ~10 tokens",
    )
    parser.add_argument("--padded-batch", type=int, default=8, help="samples per padded micro-batch (baseline)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the figures to this path")
    return parser.parse_args()


if __name__ == "__main__":
    main()
