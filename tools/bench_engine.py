"""Generated tokens/s of the embedded torch engine against transformers `generate()`, same model and prompts.

The workload is the one RL rollouts have: many prompts, sampled at temperature 1, with heavy-tailed
response lengths (most short, a few long). Lengths are drawn from a truncated Pareto distribution and
imposed on both sides, so both generate exactly the same number of tokens per prompt:

* baseline: `model.generate()` on consecutive batches of `--batch-size` left-padded prompts, with a
  stopping criterion that ends each row at its length; a batch runs until its longest row is done;
* engine: every prompt submitted at once to a `TorchEngine(max_batch_size=--batch-size)` with
  `max_new_tokens` = the row's length and `ignore_eos`; finished rows leave and waiting prompts join.

Both run in the same process on the same model object, interleaved per repeat (alternating which goes
first) because the CPU is shared; the table reports medians. Run:
`python -m tools.bench_engine [--quick] [--json PATH]`, and on a real model or shape (`tools/bench_models.py`):
`python -m tools.bench_engine --model smollm2 --prompts 192 --longest 1024`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import string
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList

from actors.runtime.logs import quiet_library_output
from engines.inference import GenerateRequest, SamplingParams, TorchEngine
from engines.tiny_model import TinyModelSpec, cached_tiny_model

BENCH_SPEC = TinyModelSpec(
    family="qwen2",
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)
QUICK_SPEC = TinyModelSpec(family="qwen2", max_position_embeddings=1024)


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    lengths: list[int]

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


@dataclass(frozen=True)
class Figures:
    prompts: int
    batch_size: int
    generated_tokens: int
    length_min: int
    length_median: float
    length_max: int
    repeats: int
    baseline_tokens_per_s: list[float]
    engine_tokens_per_s: list[float]
    baseline_median: float
    engine_median: float
    speedup_median: float
    threads: int
    model: dict


def heavy_tailed_lengths(count: int, shortest: int, longest: int, alpha: float, rng: random.Random) -> list[int]:
    """Truncated Pareto: P(L > x) = (shortest / x) ** alpha, capped at `longest`."""
    return [min(longest, int(shortest * (1.0 - rng.random()) ** (-1.0 / alpha))) for _ in range(count)]


def make_workload(tokenizer: AutoTokenizer, count: int, longest: int, seed: int) -> Workload:
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits + " "
    prompts = []
    for _ in range(count):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(16, 64)))
        prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    lengths = heavy_tailed_lengths(count, shortest=8, longest=longest, alpha=1.1, rng=rng)
    return Workload(prompts=prompts, lengths=lengths)


class _StopAtLength(StoppingCriteria):
    """Ends each row of a `generate()` batch after its own number of new tokens."""

    def __init__(self, prompt_width: int, lengths: list[int]) -> None:
        self.prompt_width = prompt_width
        self.lengths = torch.tensor(lengths)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor | None, **kwargs: object) -> torch.Tensor:
        return (input_ids.shape[1] - self.prompt_width) >= self.lengths.to(input_ids.device)


def run_baseline(model: torch.nn.Module, workload: Workload, batch_size: int, pad_id: int) -> tuple[float, int]:
    generated = 0
    start = time.perf_counter()
    for first in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[first : first + batch_size]
        lengths = workload.lengths[first : first + batch_size]
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            output = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max(lengths),
                stopping_criteria=StoppingCriteriaList([_StopAtLength(width, lengths)]),
                eos_token_id=None,
                pad_token_id=pad_id,
            )
        generated += sum(min(length, output.shape[1] - width) for length in lengths)
    return time.perf_counter() - start, generated


async def _engine_pass(engine: TorchEngine, workload: Workload, tag: str) -> int:
    requests = [
        GenerateRequest(f"{tag}-{i}", prompt, SamplingParams(temperature=1.0, max_new_tokens=length, ignore_eos=True))
        for i, (prompt, length) in enumerate(zip(workload.prompts, workload.lengths, strict=True))
    ]
    outputs = await asyncio.gather(*(engine.generate(request) for request in requests))
    return sum(len(output[0].output_ids) for output in outputs)


def run_engine(engine: TorchEngine, workload: Workload, tag: str) -> tuple[float, int]:
    start = time.perf_counter()
    generated = asyncio.run(_engine_pass(engine, workload, tag))
    return time.perf_counter() - start, generated


def benchmark(args: argparse.Namespace) -> Figures:
    spec = QUICK_SPEC if args.quick else BENCH_SPEC
    if args.model is not None:
        from tools.bench_models import bench_model

        path = bench_model(args.model)
    else:
        cache_dir = Path(args.model_cache or Path(tempfile.gettempdir()) / "slipstream-bench-models")
        path = cached_tiny_model(cache_dir, spec)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    workload = make_workload(tokenizer, args.prompts, args.longest, seed=args.seed)
    engine = TorchEngine(model, tokenizer, max_batch_size=args.batch_size, seed=args.seed)
    torch.manual_seed(args.seed)

    # Warm-up both paths once on a slice so lazy initialization stays out of the timings.
    warm = Workload(workload.prompts[:4], [4] * 4)
    run_baseline(model, warm, args.batch_size, tokenizer.pad_token_id)
    run_engine(engine, warm, "warm")

    baseline_rates, engine_rates = [], []
    for repeat in range(args.repeats):
        order = ("baseline", "engine") if repeat % 2 == 0 else ("engine", "baseline")
        for which in order:
            if which == "baseline":
                seconds, generated = run_baseline(model, workload, args.batch_size, tokenizer.pad_token_id)
                baseline_rates.append(generated / seconds)
            else:
                seconds, generated = run_engine(engine, workload, f"r{repeat}")
                engine_rates.append(generated / seconds)
            if generated != workload.tokens:
                raise RuntimeError(f"{which} generated {generated} tokens, the workload asks for {workload.tokens}")
    asyncio.run(engine.close())

    ratios = [e / b for e, b in zip(engine_rates, baseline_rates, strict=True)]
    return Figures(
        prompts=len(workload.prompts),
        batch_size=args.batch_size,
        generated_tokens=workload.tokens,
        length_min=min(workload.lengths),
        length_median=statistics.median(workload.lengths),
        length_max=max(workload.lengths),
        repeats=args.repeats,
        baseline_tokens_per_s=baseline_rates,
        engine_tokens_per_s=engine_rates,
        baseline_median=statistics.median(baseline_rates),
        engine_median=statistics.median(engine_rates),
        speedup_median=statistics.median(ratios),
        threads=torch.get_num_threads(),
        model=_shape(model, args.model or spec.family),
    )


def _shape(model: torch.nn.Module, name: str) -> dict:
    config = model.config
    return {"family": name, "hidden_size": config.hidden_size, "num_hidden_layers": config.num_hidden_layers,
            "vocab_size": config.vocab_size, "parameters": sum(p.numel() for p in model.parameters())}


def print_table(figures: Figures) -> None:
    spec = figures.model
    print(
        f"model: {spec['family']} hidden={spec['hidden_size']} layers={spec['num_hidden_layers']} "
        f"vocab={spec['vocab_size']} params={spec['parameters'] / 1e6:.0f}M (fp32, CPU, "
        f"{figures.threads} threads) | {figures.prompts} prompts, batch {figures.batch_size} | response lengths "
        f"min/median/max = {figures.length_min}/{figures.length_median:g}/{figures.length_max}, "
        f"{figures.generated_tokens} tokens per pass | median of {figures.repeats} interleaved repeats"
    )
    rows = [
        ("transformers generate() (static batches)", figures.baseline_median, 1.0),
        ("TorchEngine (continuous batching)", figures.engine_median, figures.speedup_median),
    ]
    print(f"{'generator':<44}{'tokens/s':>12}{'speedup':>10}")
    for name, rate, speedup in rows:
        print(f"{name:<44}{rate:>12.0f}{speedup:>9.2f}x")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run on the smallest tiny model")
    parser.add_argument("--json", type=Path, help="write the figures to this JSON file")
    parser.add_argument("--prompts", type=int, help="number of prompts (default 256; 64 with --quick)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--longest", type=int, help="cap on response length (default 512; 64 with --quick)")
    parser.add_argument("--repeats", type=int, help="interleaved repeats (default 3; 1 with --quick)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        help="torch intra-op threads for both sides (default: torch's own choice); 1 is steadier on a shared CPU",
    )
    parser.add_argument("--model-cache", type=Path, help="where the benchmark model is built (default: tmp)")
    parser.add_argument("--model", help="a real model or shape instead of the tiny one: smollm2 or qwen2.5-0.5b")
    args = parser.parse_args(argv)
    args.prompts = args.prompts or (64 if args.quick else 256)
    args.longest = args.longest or (64 if args.quick else 512)
    args.repeats = args.repeats or (1 if args.quick else 3)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_library_output()  # transformers' load and save bars otherwise interleave with the table
    if args.threads:
        torch.set_num_threads(args.threads)
    figures = benchmark(args)
    print_table(figures)
    if args.json:
        args.json.write_text(json.dumps(asdict(figures), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
