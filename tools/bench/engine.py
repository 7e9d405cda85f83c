"""Generated tokens/s of the embedded torch engine against transformers `generate()`, same model and prompts.

The workload is the one RL rollouts have: many prompts, sampled at temperature 1, with heavy-tailed
response lengths (most short, a few long). Lengths are drawn from a truncated Pareto distribution and
imposed on both sides, so both generate exactly the same number of tokens per prompt:

* baseline: `model.generate()` on consecutive batches of `--batch-size` left-padded prompts, with a
  stopping criterion that ends each row at its length; a batch runs until its longest row is done;
* engine: every prompt submitted at once to a `TorchEngine(max_batch_size=--batch-size)` with
  `max_new_tokens` = the row's length and `ignore_eos`; finished rows leave and waiting prompts join.

Each timed pass runs in a process of its own, forked from this one (which loads no model: tools/bench/forked.py),
that loads the model, warms its side up once and generates the workload: an engine serves from its own process (a
rollout worker), and in one shared process the second pass ran on what the first left of the heap (after
`generate()` the engine's decode steps took 402 ms instead of 263 ms and its evictions 210 ms instead of 37 ms, on
SmolLM2). Passes are interleaved per repeat (alternating which goes first) because the CPU is shared; the table
reports medians. Run:
`python -m tools.bench.engine [--quick] [--json PATH]`, and on a real model or shape (`tools/bench/models.py`):
`python -m tools.bench.engine --model smollm2 --prompts 192 --longest 1024`.

`--workload word-problems` (a real model) takes the lengths from the model instead: the demo's harder task's word
problems in its chat template, each answered once by the engine at temperature 0.7 until its end token or
`--longest`; those lengths are then imposed on both sides as above. These are the long answers of an RL run on a
reasoning task (80-190 tokens from SmolLM2, a few running to the cap), not a drawn distribution.
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
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList

from engines.inference import GenerateRequest, SamplingParams, TorchEngine
from tools.bench.forked import forked_output
from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model

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
    workload: str


def heavy_tailed_lengths(count: int, shortest: int, longest: int, alpha: float, rng: random.Random) -> list[int]:
    """Truncated Pareto: P(L > x) = (shortest / x) ** alpha, capped at `longest`."""
    return [min(longest, int(shortest * (1.0 - rng.random()) ** (-1.0 / alpha))) for _ in range(count)]


def make_workload(tokenizer: AutoTokenizer, count: int, longest: int, seed: int) -> Workload:
    """Random-text prompts with lengths drawn from a truncated Pareto distribution (most short, a few long)."""
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits + " "
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(16, 64))) for _ in range(count)]
    prompts = [_chat_prompt(tokenizer, text) for text in texts]
    lengths = heavy_tailed_lengths(count, shortest=8, longest=longest, alpha=1.1, rng=rng)
    return Workload(prompts=prompts, lengths=lengths)


def _chat_prompt(tokenizer: AutoTokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)


def word_problem_workload(engine: TorchEngine, tokenizer: AutoTokenizer, count: int, longest: int,
                          seed: int) -> Workload:
    """Word problems, each with the length of the engine's own sampled answer (its end token or `longest`)."""
    from tools.make_arithmetic_data import word_problems

    questions = word_problems(seed)
    random.Random(seed).shuffle(questions)
    if len(questions) < count:
        raise SystemExit(f"bench_engine: --prompts {count} is more than the {len(questions)} word problems")
    prompts = [_chat_prompt(tokenizer, q["input"]) for q in questions[:count]]

    async def answer_lengths() -> list[int]:
        params = SamplingParams(temperature=0.7, max_new_tokens=longest, seed=seed)
        outputs = await asyncio.gather(*(engine.generate(GenerateRequest(f"lengths-{i}", prompt, params))
                                         for i, prompt in enumerate(prompts)))
        return [len(output[0].output_ids) for output in outputs]

    return Workload(prompts=prompts, lengths=asyncio.run(answer_lengths()))


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


def timed_pass(which: str, model_path: Path, workload_path: Path, args: argparse.Namespace, tag: str,
               threads: int) -> dict:
    """What one side measured generating the workload (its seconds, and the model's shape), in a fresh process
    forked from this one, which loads no model (see the module docstring and tools/bench/forked.py)."""
    one = argparse.Namespace(**{**vars(args), "pass_": which, "pass_model": model_path,
                                "pass_workload": workload_path, "pass_tag": tag})
    return _in_fork(lambda: run_pass(one), threads, workload_path.parent / f"{which}-{tag}.err", f"the {which} pass")


def _in_fork(side: Callable[[], None], threads: int, errors: Path, what: str) -> dict:
    """The JSON line `side` prints last, run on `threads` threads in a process forked from this one."""

    def run() -> None:
        torch.set_num_threads(threads)
        side()

    code, output = forked_output(run, errors)
    if code != 0:
        raise RuntimeError(f"bench_engine: {what} exited with {code}:\n{errors.read_text()[-3000:]}")
    return json.loads(output.strip().splitlines()[-1])


def run_pass(args: argparse.Namespace) -> None:
    """The child's side of `timed_pass`: warm up on a slice, generate the workload, print the seconds as JSON."""
    model = AutoModelForCausalLM.from_pretrained(args.pass_model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.pass_model)
    workload = Workload(**json.loads(args.pass_workload.read_text()))
    torch.manual_seed(args.seed)
    warm = Workload(workload.prompts[:4], [4] * 4)  # lazy initialization stays out of the timing
    if args.pass_ == "baseline":
        run_baseline(model, warm, args.batch_size, tokenizer.pad_token_id)
        seconds, generated = run_baseline(model, workload, args.batch_size, tokenizer.pad_token_id)
    else:
        engine = TorchEngine(model, tokenizer, max_batch_size=args.batch_size, seed=args.seed)
        run_engine(engine, warm, "warm")
        seconds, generated = run_engine(engine, workload, args.pass_tag)
        asyncio.run(engine.close())
    if generated != workload.tokens:
        raise RuntimeError(f"{args.pass_} generated {generated} tokens, the workload asks for {workload.tokens}")
    print(json.dumps({"seconds": seconds, "model": _shape(model)}))


def benchmark(args: argparse.Namespace) -> Figures:
    threads = args.threads or torch.get_num_threads()  # each pass's
    torch.set_num_threads(1)  # the passes fork from here (tools/bench/forked.py)
    spec = QUICK_SPEC if args.quick else BENCH_SPEC
    if args.model is not None:
        from tools.bench.models import bench_model

        path = bench_model(args.model)
    else:
        cache_dir = Path(args.model_cache or Path(tempfile.gettempdir()) / "slipstream-bench-models")
        path = cached_tiny_model(cache_dir, spec)
    tokenizer = AutoTokenizer.from_pretrained(path)
    baseline_rates, engine_rates = [], []
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as scratch:
        if args.workload == "word-problems":  # the model's answers, sampled in a process of their own as well
            workload = Workload(**_in_fork(lambda: _print_word_problems(path, args), threads,
                                           Path(scratch) / "word-problems.err", "sampling the word problems"))
        else:
            workload = make_workload(tokenizer, args.prompts, args.longest, seed=args.seed)
        workload_path = Path(scratch) / "workload.json"
        workload_path.write_text(json.dumps(asdict(workload)))
        for repeat in range(args.repeats):
            order = ("baseline", "engine") if repeat % 2 == 0 else ("engine", "baseline")
            for which in order:
                measured = timed_pass(which, path, workload_path, args, f"r{repeat}", threads)
                (baseline_rates if which == "baseline" else engine_rates).append(workload.tokens / measured["seconds"])

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
        threads=threads,
        model={"family": args.model or spec.family, **measured["model"]},
        workload=args.workload,
    )


def _print_word_problems(path: Path, args: argparse.Namespace) -> None:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = TorchEngine(model, tokenizer, max_batch_size=args.batch_size, seed=args.seed)
    workload = word_problem_workload(engine, tokenizer, args.prompts, args.longest, seed=args.seed)
    asyncio.run(engine.close())
    print(json.dumps(asdict(workload)))


def _shape(model: torch.nn.Module) -> dict:
    config = model.config
    return {"hidden_size": config.hidden_size, "num_hidden_layers": config.num_hidden_layers,
            "vocab_size": config.vocab_size, "parameters": sum(p.numel() for p in model.parameters())}


def print_table(figures: Figures) -> None:
    spec = figures.model
    print(
        f"model: {spec['family']} hidden={spec['hidden_size']} layers={spec['num_hidden_layers']} "
        f"vocab={spec['vocab_size']} params={spec['parameters'] / 1e6:.0f}M (fp32, CPU, "
        f"{figures.threads} threads) | {figures.prompts} {figures.workload} prompts, batch {figures.batch_size} | "
        "response lengths "
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
    # One timed pass in a fresh process (`timed_pass`); not for users.
    parser.add_argument("--pass", dest="pass_", choices=("baseline", "engine"), help=argparse.SUPPRESS)
    parser.add_argument("--pass-model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--pass-workload", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--pass-tag", default="r0", help=argparse.SUPPRESS)
    parser.add_argument("--model-cache", type=Path, help="where the benchmark model is built (default: tmp)")
    parser.add_argument("--model", help="a real model or shape instead of the tiny one: smollm2 or qwen2.5-0.5b")
    parser.add_argument("--workload", choices=("heavy-tailed", "word-problems"), default="heavy-tailed",
                        help="heavy-tailed: random prompts, Pareto-drawn lengths; word-problems (a real model): the "
                             "lengths of the model's own answers to the demo's word problems")
    args = parser.parse_args(argv)
    if args.workload == "word-problems" and args.model is None:
        parser.error("--workload word-problems needs --model (a real model answers them; the tiny one cannot)")
    args.prompts = args.prompts or (64 if args.quick else 256)
    args.longest = args.longest or (64 if args.quick else 512)
    args.repeats = args.repeats or (1 if args.quick else 3)
    return args


def main(argv: list[str] | None = None) -> int:
    from tools.bench.passes import run_benchmark

    return run_benchmark(parse_args(argv), run_pass=run_pass, benchmark=benchmark, print_table=print_table)


if __name__ == "__main__":
    sys.exit(main())
