"""Multi-turn episodes over 4 engines, each in a rollout-worker-like process of its own, routed by session affinity,
by round-robin, and with no prefix cache at all: how much of the history each turn could reuse it did reuse, the
prefill tokens per turn, and turns/s.

Each of `--engines` processes is what a rollout worker is to routing: a torch engine with its prefix cache, served
to the others over the bus (`actors/rollout/engine_service.py`), and its share of the episodes, whose calls its own
router (`actors/rollout/router.py`) sends over all the engines. The workload is tools/bench/prefix_cache.py's: groups
of episodes that share a prompt, each turn sending the whole conversation so far with a tool's reply since the last
answer, every answer `--answer` sampled tokens (seeded, end token ignored, so every pass generates the same
number).

A turn's reusable tokens are the history whose keys and values the session's earlier turns computed (its input
minus the tool reply that came since the previous answer and that answer's last token, which was sampled but never
fed to the model); it reused what its engine took from the cache, up to that. "Own history" leaves out the prompt
that a group's episodes share, which any engine that ran one of them holds. The passes:
`affinity` (each episode keyed by its session: the default), `round-robin` (the baseline that ignores the cache),
`no cache` (affinity, the engines' prefix caches off). Every pass starts fresh processes, forked from this one
(tools/bench/forked.py: imports done once, no engine run before); the passes alternate in order per repeat and the
table reports medians.

    python -m tools.bench.router [--quick] [--json PATH] [--engines 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tools.bench.forked import ForkedWorker
from tools.bench.prefix_cache import Workload, make_workload, model_path

PASSES = {"affinity": ("affinity", True), "round-robin": ("round-robin", True), "no cache": ("affinity", False)}


@dataclass(frozen=True)
class EpisodeTurns:
    inputs: list[int]  # per turn: prompt tokens sent
    cached: list[int]  # per turn: of those, taken from the engine's cache
    reusable: list[int]  # per turn: of those, the history the session's earlier turns computed
    prompt: int  # the episode's prompt, which the other episodes of its group share


@dataclass(frozen=True)
class PassResult:
    seconds: float
    episodes: list[EpisodeTurns]
    calls_per_engine: dict[str, int]

    @property
    def reused_fraction(self) -> float:
        reusable = sum(sum(episode.reusable) for episode in self.episodes)
        reused = sum(min(cached, could) for episode in self.episodes
                     for cached, could in zip(episode.cached, episode.reusable, strict=True))
        return reused / reusable if reusable else 0.0

    @property
    def own_reused_fraction(self) -> float:
        """The same, for the tokens the session itself added (answers and tool replies), which no other episode
        shares: only the engine that ran its previous turns holds them."""
        own = sum(max(0, could - episode.prompt) for episode in self.episodes for could in episode.reusable)
        reused = sum(max(0, min(cached, could) - episode.prompt) for episode in self.episodes
                     for cached, could in zip(episode.cached, episode.reusable, strict=True))
        return reused / own if own else 0.0

    def prefill_per_turn(self) -> list[float]:
        turns = len(self.episodes[0].inputs)
        return [statistics.mean(episode.inputs[turn] - episode.cached[turn] for episode in self.episodes)
                for turn in range(turns)]


@dataclass(frozen=True)
class PassFigures:
    name: str
    turns_per_s: float
    reused_fraction: float
    own_reused_fraction: float
    prefill_per_turn: list[float]
    seconds: list[float]
    calls_per_engine: dict[str, int]


@dataclass(frozen=True)
class Figures:
    model: dict
    engines: int
    episodes: int
    group: int
    turns: int
    answer_tokens: int
    reply_tokens: float
    repeats: int
    input_per_turn: list[float]
    reusable_per_turn: list[float]
    passes: list[PassFigures]


# --------------------------------------------------------------------------------------------- one worker process
async def run_worker(args: argparse.Namespace) -> None:
    """An engine served to the others and this worker's share of the episodes, routed over every engine."""
    import torch
    import zmq.asyncio
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from actors.rollout.engine_service import EngineService
    from actors.rollout.router import EngineRouter
    from bus.address import bind_address
    from bus.schema import Member
    from engines.inference import GenerateRequest, SamplingParams, TorchEngine

    torch.set_num_threads(args.threads or 1)
    model = AutoModelForCausalLM.from_pretrained(args.pass_model, dtype=torch.float32).eval()
    engine = TorchEngine(model, AutoTokenizer.from_pretrained(args.pass_model), max_batch_size=64,
                         seed=args.worker, prefix_cache_bytes=args.cache_mb << 20 if args.cache else 0)
    workload = Workload(**json.loads(args.pass_workload.read_text()))
    context = zmq.asyncio.Context()
    service = EngineService(engine, zmq_context=context, bind=bind_address())
    serving = asyncio.ensure_future(service.serve())
    me = f"engine-{args.worker}"
    router = EngineRouter(engine, local_id=me, policy=args.policy, slack=args.slack, timeout=600.0,
                          zmq_context=context, service=service)
    await engine.generate(GenerateRequest("warm", [3, 4, 5, 6], SamplingParams(max_new_tokens=4)))  # off the clock
    print(json.dumps({"endpoint": service.endpoint}), flush=True)
    endpoints = json.loads(await asyncio.to_thread(sys.stdin.readline))  # the roster, and the start
    router.sync({name: Member(actor_id=name, role="rollout", node="bench", pid=0, endpoints={"engine": endpoint})
                 for name, endpoint in endpoints.items()})

    async def episode(index: int) -> EpisodeTurns:
        history, inputs, cached, reusable = list(workload.prompts[index]), [], [], []
        computed = 0  # tokens of this session whose keys and values an engine computed in its earlier turns
        for turn in range(len(workload.replies[index]) + 1):
            params = SamplingParams(temperature=1.0, max_new_tokens=workload.answer_tokens, ignore_eos=True,
                                    seed=workload.seed * 1_000_003 + index * 1009 + turn)
            call = GenerateRequest(f"{me}/{index}/{turn}", history, params, routing_key=f"episode-{index}")
            [output] = await router.generate(call)
            inputs.append(len(history))
            cached.append(output.cached_tokens)
            reusable.append(computed)
            computed = len(history) + len(output.output_ids) - 1  # an answer's last token is sampled, never fed
            if turn < len(workload.replies[index]):
                history = history + output.output_ids + workload.replies[index][turn]
        return EpisodeTurns(inputs, cached, reusable, len(workload.prompts[index]))

    mine = range(args.worker, len(workload.prompts), args.workers)
    episodes = await asyncio.gather(*(episode(index) for index in mine))
    calls = {engine_id: tally.calls for engine_id, tally in router.tallies.items()}
    print(json.dumps({"episodes": [asdict(done) for done in episodes], "calls": calls}), flush=True)
    await asyncio.to_thread(sys.stdin.readline)  # keep serving the others until every worker is done
    router.close()
    service.close()
    serving.cancel()
    await engine.close()
    context.destroy(linger=0)


def run_pass(args: argparse.Namespace) -> None:
    asyncio.run(run_worker(args))


# --------------------------------------------------------------------------------------------- the parent
def timed_pass(name: str, model: Path, workload_path: Path, args: argparse.Namespace) -> PassResult:
    """Start the workers, give them the roster, time their episodes, collect what they measured."""
    policy, cache = PASSES[name]
    workers = []
    for index in range(args.engines):
        worker = argparse.Namespace(**{**vars(args), "pass_": name, "pass_model": model,
                                       "pass_workload": workload_path, "worker": index, "workers": args.engines,
                                       "policy": policy, "cache": cache})
        errors = workload_path.parent / f"{name}-{index}.err"  # read back if the worker fails
        workers.append(ForkedWorker(lambda worker=worker: run_pass(worker), errors))
    try:
        endpoints = {f"engine-{index}": _line(worker, name, workload_path.parent / f"{name}-{index}.err")["endpoint"]
                     for index, worker in enumerate(workers)}
        started = time.perf_counter()
        for worker in workers:
            _send(worker, json.dumps(endpoints))
        results = [_line(worker, name, workload_path.parent / f"{name}-{index}.err")
                   for index, worker in enumerate(workers)]
        seconds = time.perf_counter() - started
        for worker in workers:
            _send(worker, "stop")
        for worker in workers:
            worker.wait(timeout=60)
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
    episodes = [EpisodeTurns(**episode) for result in results for episode in result["episodes"]]
    calls: dict[str, int] = {}
    for result in results:
        for engine, count in result["calls"].items():
            calls[engine] = calls.get(engine, 0) + count
    return PassResult(seconds, episodes, dict(sorted(calls.items())))


def _line(worker: ForkedWorker, name: str, errors: Path) -> dict[str, Any]:
    assert worker.stdout is not None
    line = worker.stdout.readline()
    if not line:
        worker.wait(timeout=60)
        error = errors.read_text()
        raise RuntimeError(f"bench router: a worker of the {name!r} pass exited with {worker.returncode}:\n"
                           f"{error[-3000:]}")
    return json.loads(line)


def _send(worker: ForkedWorker, line: str) -> None:
    assert worker.stdin is not None
    worker.stdin.write(line + "\n")
    worker.stdin.flush()


def benchmark(args: argparse.Namespace) -> Figures:
    import torch
    from transformers import AutoConfig, AutoTokenizer

    torch.set_num_threads(1)  # whatever --threads says: the workers fork from here (tools/bench/forked.py)
    path = model_path(args)
    workload = make_workload(AutoTokenizer.from_pretrained(path), args.episodes, args.group, args.turns, args.answer,
                             args.reply, args.seed)
    results: dict[str, list[PassResult]] = {name: [] for name in PASSES}
    with tempfile.TemporaryDirectory(prefix="bench-router-") as scratch:
        workload_path = Path(scratch) / "workload.json"
        workload_path.write_text(json.dumps(asdict(workload)))
        for repeat in range(args.repeats):
            order = list(PASSES) if repeat % 2 == 0 else list(reversed(PASSES))
            for name in order:
                results[name].append(timed_pass(name, path, workload_path, args))
    turns = args.episodes * args.turns
    first = results["affinity"][0]
    config = AutoConfig.from_pretrained(path)
    return Figures(
        model={"name": args.model or ("quick" if args.quick else "bench"), "hidden_size": config.hidden_size,
               "num_hidden_layers": config.num_hidden_layers, "vocab_size": config.vocab_size},
        engines=args.engines, episodes=args.episodes, group=args.group, turns=args.turns, answer_tokens=args.answer,
        reply_tokens=statistics.mean(len(reply) for replies in workload.replies for reply in replies)
        if args.turns > 1 else 0.0,
        repeats=args.repeats,
        input_per_turn=[statistics.mean(episode.inputs[turn] for episode in first.episodes)
                        for turn in range(args.turns)],
        reusable_per_turn=[statistics.mean(episode.reusable[turn] for episode in first.episodes)
                           for turn in range(args.turns)],
        passes=[PassFigures(name=name, turns_per_s=statistics.median(turns / run.seconds for run in runs),
                            reused_fraction=statistics.median(run.reused_fraction for run in runs),
                            own_reused_fraction=statistics.median(run.own_reused_fraction for run in runs),
                            prefill_per_turn=runs[0].prefill_per_turn(), seconds=[run.seconds for run in runs],
                            calls_per_engine=runs[0].calls_per_engine)
                for name, runs in results.items()],
    )


def print_table(figures: Figures) -> None:
    model = figures.model
    print(f"model: {model['name']} hidden={model['hidden_size']} layers={model['num_hidden_layers']} "
          f"vocab={model['vocab_size']} (fp32, CPU) | {figures.engines} engines, one process each | "
          f"{figures.episodes} episodes in groups of {figures.group} x {figures.turns} turns, {figures.answer_tokens} "
          f"tokens per answer, tool replies of {figures.reply_tokens:.0f} tokens | median of {figures.repeats} "
          "interleaved repeats")
    print(f"{'routing':<14}{'turns/s':>9}{'vs no cache':>13}{'history reused':>16}{'own history':>13}   "
          "prefill tokens per turn (turn 1, 2, ...)")
    baseline = next(figures_.turns_per_s for figures_ in figures.passes if figures_.name == "no cache")
    for row in figures.passes:
        prefill = ", ".join(f"{tokens:.0f}" for tokens in row.prefill_per_turn)
        print(f"{row.name:<14}{row.turns_per_s:>9.2f}{row.turns_per_s / baseline:>12.2f}x"
              f"{100 * row.reused_fraction:>15.1f}%{100 * row.own_reused_fraction:>12.1f}%   {prefill}")
    print(f"input tokens per turn: {', '.join(f'{tokens:.0f}' for tokens in figures.input_per_turn)}; of them "
          f"history an earlier turn computed: {', '.join(f'{tokens:.0f}' for tokens in figures.reusable_per_turn)} "
          "(own history: what the session added beyond its group's prompt)")
    for row in figures.passes:
        print(f"calls per engine ({row.name}): {row.calls_per_engine}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run on the smallest tiny model")
    parser.add_argument("--json", type=Path, help="write the figures to this JSON file")
    parser.add_argument("--model", help="a real model instead of the tiny one: smollm2 (tools/bench/models.py)")
    parser.add_argument("--model-cache", type=Path, help="where the tiny benchmark model is built (default: tmp)")
    parser.add_argument("--engines", type=int, default=4, help="engines, each in a worker process of its own")
    parser.add_argument("--episodes", type=int, help="conversations run at once (default 32; 8 with --quick)")
    parser.add_argument("--group", type=int, default=4, help="episodes per shared prompt (a GRPO group)")
    parser.add_argument("--turns", type=int, help="model turns per episode (default 4; 3 with --quick)")
    parser.add_argument("--answer", type=int, help="tokens per model turn (default 32; 8 with --quick)")
    parser.add_argument("--reply", type=int, default=24, help="tokens of a tool's reply between turns (about)")
    parser.add_argument("--slack", type=float, default=1.0, help="affinity's load bound (--router-load-slack)")
    parser.add_argument("--cache-mb", type=int, default=1024, help="each engine's prefix cache budget in MiB")
    parser.add_argument("--repeats", type=int, help="interleaved repeats (default 3; 1 with --quick)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="torch intra-op threads per engine (default 1)")
    parser.add_argument("--pass", dest="pass_", choices=tuple(PASSES), help=argparse.SUPPRESS)
    parser.add_argument("--pass-model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--pass-workload", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--policy", default="affinity", help=argparse.SUPPRESS)
    parser.add_argument("--cache", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.episodes = args.episodes or (8 if args.quick else 32)
    args.turns = args.turns or (3 if args.quick else 4)
    args.answer = args.answer or (8 if args.quick else 32)
    args.repeats = args.repeats or (1 if args.quick else 3)
    for name in ("engines", "episodes", "group", "turns", "answer", "reply", "cache_mb", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.slack < 0:
        parser.error(f"--slack must be >= 0, got {args.slack}")
    return args


def main(argv: list[str] | None = None) -> int:
    from tools.bench.passes import run_benchmark

    return run_benchmark(parse_args(argv), run_pass=run_pass, benchmark=benchmark, print_table=print_table)


if __name__ == "__main__":
    sys.exit(main())
