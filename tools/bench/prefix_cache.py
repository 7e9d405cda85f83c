"""Multi-turn episodes on one torch engine, with its prefix cache and without: prefill tokens per turn and turns/s.

The workload is an agentic RL rollout's: `--episodes` conversations run at once, in groups of `--group` that share
their prompt (a GRPO group's samples, each its own session), all behind one system prompt. Each of `--turns` turns
sends the whole conversation so far, as a chat client does (`actors/rollout/chat_session.py`), and samples
`--answer` tokens (temperature 1, seeded per episode and turn, end token ignored, so both sides generate exactly
the same number of tokens); between turns a tool's reply of about `--reply` tokens joins the conversation.

Each pass (cache on, cache off) runs in a process of its own, forked from this one (tools/bench/forked.py), that
loads the model, warms its engine up on another conversation and runs the workload, for the reason
tools/bench/engine.py gives; passes alternate which goes first
per repeat and the table reports medians. Prefill tokens are counted per request: its input minus what the engine
took from its cache (`GenerateOutput.cached_tokens`). Seeded sampling makes both sides draw the same tokens unless
rounding moves a draw across a boundary (the stock kernels round with the forward's shape, which the cache and the
timing of the other episodes change; `--deterministic` rules that out); the table says how many episodes came out
token for token the same.

    python -m tools.bench.prefix_cache [--quick] [--json PATH] [--model smollm2] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tools.bench.forked import forked_output

SYSTEM_PROMPT = ("You are an agent that solves arithmetic tasks with a calculator tool. Think step by step, call "
                 "the tool with a JSON object for every operation, check its answer, and reply with the final number "
                 "only.")
WORDS = ("sum", "carry", "seven", "table", "result", "apple", "river", "stone", "eleven", "cloud", "digit", "merge")


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]  # per episode
    replies: list[list[list[int]]]  # per episode, per turn but the last: the tool's reply
    answer_tokens: int
    seed: int


@dataclass(frozen=True)
class PassResult:
    seconds: float
    prefill_per_turn: list[float]  # mean over episodes, per turn index
    input_per_turn: list[float]
    outputs: list[list[list[int]]]  # per episode, per turn
    reused_fraction: float


@dataclass(frozen=True)
class Figures:
    model: dict
    episodes: int
    group: int
    turns: int
    answer_tokens: int
    reply_tokens: float
    threads: int
    repeats: int
    deterministic: bool
    turns_per_s_off: float
    turns_per_s_on: float
    speedup: float
    prefill_per_turn_off: list[float]
    prefill_per_turn_on: list[float]
    input_per_turn: list[float]
    prefill_tokens_saved: float  # share of the baseline's prefill tokens the cache did not compute
    identical_episodes: int
    seconds_off: list[float]
    seconds_on: list[float]


def make_workload(tokenizer: object, episodes: int, group: int, turns: int, answer: int, reply: int,
                  seed: int) -> Workload:
    """Prompts (the system prompt, then a question a group shares) in the model's chat template, and tool replies
    as the template frames a tool's turn."""
    rng = random.Random(seed)
    prompts, replies = [], []
    for episode in range(episodes):
        if episode % group == 0:
            question = f"Task {episode // group}: " + " ".join(rng.choice(WORDS) for _ in range(12))
            messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
            prompt = _ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True))  # type: ignore[attr-defined]
        prompts.append(prompt)
        replies.append([_tool_turn(tokenizer, rng, reply) for _ in range(turns - 1)])
    return Workload(prompts, replies, answer, seed)


def _tool_turn(tokenizer: object, rng: random.Random, tokens: int) -> list[int]:
    words: list[str] = []
    while True:
        text = f"<|im_end|>\n<|im_start|>tool\n{' '.join(words)}<|im_end|>\n<|im_start|>assistant\n"
        ids = tokenizer.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
        if len(ids) >= tokens:
            return list(ids)
        words.append(rng.choice(WORDS) if rng.random() < 0.7 else str(rng.randint(0, 999)))


def _ids(rendered: object) -> list[int]:
    return list(rendered["input_ids"]) if hasattr(rendered, "keys") else list(rendered)  # type: ignore[index]


async def run_episodes(engine: object, workload: Workload, tag: str) -> tuple[list[list[object]], list[list[int]]]:
    """Every episode at once, each one turn after another; returns each turn's output and input length."""
    from engines.inference import GenerateRequest, SamplingParams

    async def episode(index: int) -> tuple[list[object], list[int]]:
        history, outputs, lengths = list(workload.prompts[index]), [], []
        for turn in range(len(workload.replies[index]) + 1):
            params = SamplingParams(temperature=1.0, max_new_tokens=workload.answer_tokens, ignore_eos=True,
                                    seed=workload.seed * 1_000_003 + index * 1009 + turn)
            [output] = await engine.generate(GenerateRequest(f"{tag}-{index}-{turn}", history, params))  # type: ignore[attr-defined]
            outputs.append(output)
            lengths.append(len(history))
            if turn < len(workload.replies[index]):
                history = history + output.output_ids + workload.replies[index][turn]
        return outputs, lengths

    done = await asyncio.gather(*(episode(index) for index in range(len(workload.prompts))))
    return [outputs for outputs, _ in done], [lengths for _, lengths in done]


def run_pass(args: argparse.Namespace) -> None:
    """One side in this process: warm up, run the workload, print what it measured as JSON."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engines.inference import TorchEngine

    model = AutoModelForCausalLM.from_pretrained(args.pass_model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.pass_model)
    workload = Workload(**json.loads(args.pass_workload.read_text()))
    warm = Workload([[3, 4, 5, 6, 7, 8]], [[[9, 10, 11]]], 4, workload.seed)  # lazy initialization off the clock
    budget = 0 if args.pass_ == "off" else args.cache_mb << 20
    engine = TorchEngine(model, tokenizer, max_batch_size=args.batch_size, seed=args.seed, prefix_cache_bytes=budget,
                         deterministic=args.deterministic)

    async def measure() -> PassResult:
        await run_episodes(engine, warm, "warm")
        start = time.perf_counter()
        outputs, lengths = await run_episodes(engine, workload, "bench")
        seconds = time.perf_counter() - start
        await engine.close()
        turns = len(lengths[0])
        prefill = [[length - output.cached_tokens for length, output in zip(episode_lengths, episode_outputs,
                                                                            strict=True)]
                   for episode_lengths, episode_outputs in zip(lengths, outputs, strict=True)]
        inputs = sum(sum(episode) for episode in lengths)
        return PassResult(
            seconds=seconds,
            prefill_per_turn=[statistics.mean(episode[turn] for episode in prefill) for turn in range(turns)],
            input_per_turn=[statistics.mean(episode[turn] for episode in lengths) for turn in range(turns)],
            outputs=[[output.output_ids for output in episode] for episode in outputs],
            reused_fraction=1 - sum(sum(episode) for episode in prefill) / inputs,
        )

    print(json.dumps(asdict(asyncio.run(measure()))))


def timed_pass(which: str, model: Path, workload_path: Path, args: argparse.Namespace, threads: int) -> PassResult:
    """One side in a fresh process, forked from this one (imports done, no engine run)."""
    import torch

    one = argparse.Namespace(**{**vars(args), "pass_": which, "pass_model": model, "pass_workload": workload_path})

    def side() -> None:
        torch.set_num_threads(threads)
        run_pass(one)

    errors = workload_path.parent / f"cache-{which}.err"
    code, output = forked_output(side, errors)
    if code != 0:
        raise RuntimeError(f"bench prefix_cache: the cache-{which} pass exited with {code}:\n"
                           f"{errors.read_text()[-3000:]}")
    return PassResult(**json.loads(output.strip().splitlines()[-1]))


def benchmark(args: argparse.Namespace) -> Figures:
    import torch
    from transformers import AutoConfig, AutoTokenizer

    threads = args.threads or torch.get_num_threads()  # each pass's
    torch.set_num_threads(1)  # the passes fork from here (tools/bench/forked.py)
    path = model_path(args)
    tokenizer = AutoTokenizer.from_pretrained(path)
    workload = make_workload(tokenizer, args.episodes, args.group, args.turns, args.answer, args.reply, args.seed)
    passes: dict[str, list[PassResult]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="bench-prefix-cache-") as scratch:
        workload_path = Path(scratch) / "workload.json"
        workload_path.write_text(json.dumps(asdict(workload)))
        for repeat in range(args.repeats):
            for which in (("off", "on") if repeat % 2 == 0 else ("on", "off")):
                passes[which].append(timed_pass(which, path, workload_path, args, threads))
    turns = args.episodes * args.turns
    off_rate = statistics.median(turns / result.seconds for result in passes["off"])
    on_rate = statistics.median(turns / result.seconds for result in passes["on"])
    off, on = passes["off"][0], passes["on"][0]  # token counts are the same in every repeat
    config = AutoConfig.from_pretrained(path)
    return Figures(
        model={"name": args.model or ("quick" if args.quick else "bench"), "hidden_size": config.hidden_size,
               "num_hidden_layers": config.num_hidden_layers, "vocab_size": config.vocab_size},
        episodes=args.episodes, group=args.group, turns=args.turns, answer_tokens=args.answer,
        reply_tokens=statistics.mean(len(reply) for replies in workload.replies for reply in replies)
        if args.turns > 1 else 0.0,
        threads=threads, repeats=args.repeats, deterministic=args.deterministic,
        turns_per_s_off=off_rate, turns_per_s_on=on_rate, speedup=on_rate / off_rate,
        prefill_per_turn_off=off.prefill_per_turn, prefill_per_turn_on=on.prefill_per_turn,
        input_per_turn=off.input_per_turn,
        prefill_tokens_saved=1 - sum(on.prefill_per_turn) / sum(off.prefill_per_turn),
        identical_episodes=sum(mine == theirs for mine, theirs in zip(on.outputs, off.outputs, strict=True)),
        seconds_off=[result.seconds for result in passes["off"]],
        seconds_on=[result.seconds for result in passes["on"]],
    )


def model_path(args: argparse.Namespace) -> Path:
    if args.model is not None:
        from tools.bench.models import bench_model

        return bench_model(args.model)
    from tools.bench.engine import BENCH_SPEC, QUICK_SPEC
    from tools.standins.tiny_model import cached_tiny_model

    cache_dir = Path(args.model_cache or Path(tempfile.gettempdir()) / "slipstream-bench-models")
    return cached_tiny_model(cache_dir, QUICK_SPEC if args.quick else BENCH_SPEC)


def print_table(figures: Figures) -> None:
    model = figures.model
    print(f"model: {model['name']} hidden={model['hidden_size']} layers={model['num_hidden_layers']} "
          f"vocab={model['vocab_size']} (fp32, CPU, {figures.threads} threads"
          f"{', batch-invariant' if figures.deterministic else ''}) | {figures.episodes} episodes in "
          f"groups of {figures.group} x {figures.turns} turns, {figures.answer_tokens} tokens per answer, tool "
          f"replies of {figures.reply_tokens:.0f} tokens | median of {figures.repeats} interleaved repeats")
    print(f"{'engine':<26}{'turns/s':>9}{'speedup':>9}   prefill tokens per turn (turn 1, 2, ...)")
    rows = [("without prefix cache", figures.turns_per_s_off, 1.0, figures.prefill_per_turn_off),
            ("with prefix cache", figures.turns_per_s_on, figures.speedup, figures.prefill_per_turn_on)]
    for name, rate, speedup, prefill in rows:
        print(f"{name:<26}{rate:>9.2f}{speedup:>8.2f}x   {', '.join(f'{tokens:.0f}' for tokens in prefill)}")
    print(f"input tokens per turn: {', '.join(f'{tokens:.0f}' for tokens in figures.input_per_turn)}; the cache "
          f"prefilled {100 * (1 - figures.prefill_tokens_saved):.1f}% of the baseline's prefill tokens; "
          f"{figures.identical_episodes} of {figures.episodes} episodes token for token the same")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run on the smallest tiny model")
    parser.add_argument("--json", type=Path, help="write the figures to this JSON file")
    parser.add_argument("--model", help="a real model instead of the tiny one: smollm2 (tools/bench/models.py)")
    parser.add_argument("--model-cache", type=Path, help="where the tiny benchmark model is built (default: tmp)")
    parser.add_argument("--episodes", type=int, help="conversations run at once (default 16; 4 with --quick)")
    parser.add_argument("--group", type=int, default=4, help="episodes per shared prompt (a GRPO group)")
    parser.add_argument("--turns", type=int, help="model turns per episode (default 4; 3 with --quick)")
    parser.add_argument("--answer", type=int, help="tokens per model turn (default 32; 8 with --quick)")
    parser.add_argument("--reply", type=int, default=24, help="tokens of a tool's reply between turns (about)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--cache-mb", type=int, default=1024, help="the prefix cache's budget in MiB")
    parser.add_argument("--repeats", type=int, help="interleaved repeats (default 3; 1 with --quick)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--deterministic", action="store_true",
                        help="batch-invariant decoding on both sides: each episode must come out bit for bit the same")
    parser.add_argument("--pass", dest="pass_", choices=("on", "off"), help=argparse.SUPPRESS)
    parser.add_argument("--pass-model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--pass-workload", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.episodes = args.episodes or (4 if args.quick else 16)
    args.turns = args.turns or (3 if args.quick else 4)
    args.answer = args.answer or (8 if args.quick else 32)
    args.repeats = args.repeats or (1 if args.quick else 3)
    for name in ("episodes", "group", "turns", "answer", "reply", "batch_size", "cache_mb", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> int:
    from tools.bench.passes import run_benchmark

    return run_benchmark(parse_args(argv), run_pass=run_pass, benchmark=benchmark, print_table=print_table)


if __name__ == "__main__":
    sys.exit(main())
