"""Peak device memory of a colocated learner and engine, against the same two processes keeping their memory.

    python -m tools.bench.colocate                 # on a GPU: the gpu_check model, 64 x 256 training tokens
    python -m tools.bench.colocate --cpu --quick   # the same turns on the CPU (CI smoke; see below)

A colocated run (`--colocate`) puts the learner and the engines on one device, in their own processes, taking
turns. What makes that fit is the hand-over between turns: the learner moves its AdamW moments to host memory
after each step and returns its cached blocks (`offload_optimizer`), the engine returns its cached KV blocks when
it runs out of work (`release_memory_when_idle`). This benchmark runs both processes through the same turns twice,
with the hand-over (colocated) and without it (the baseline: two processes on one device that keep what they
allocated), and reports the device's peak: for each turn, the working process's peak reserved memory plus the
resting process's reserved memory at that moment, maximised over the turns.

Reserved memory is what PyTorch's caching allocator holds from the device; each process's CUDA context (a few
hundred MB on top, the same in both modes) is not counted. The weight push between turns is not part of this
benchmark (`tools/bench/weights.py` and `gpu_check` measure it). On the CPU there is no caching allocator: the
rows show resident set sizes at turn ends, so the CPU run checks the machinery, not the saving.
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing as mp
import sys
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

TURN_DEADLINE_S = 300.0
RELEASE_DEADLINE_S = 10.0


@dataclass
class Sizes:
    train_samples: int
    train_length: int
    prompts: int
    prompt_length: int
    new_tokens: int


@dataclass
class Turn:
    """One process's memory over one of its turns, in bytes."""

    role: str
    peak: int  # while it worked
    at_rest: int  # once it handed its memory over (or kept it, in the baseline)


@dataclass
class ModeResult:
    mode: str
    learner_peak: int
    learner_at_rest: int
    engine_peak: int
    engine_at_rest: int
    device_peak: int  # the largest working-peak + resting-reserved sum over the turns
    generation_peak: int  # the same over the engine's turns: what generation (its KV cache) has to fit beside


def turn_totals(turns: list[Turn], loaded: dict[str, int]) -> list[int]:
    """For each turn, the working process's peak plus the other one's memory at rest just then."""
    resting = dict(loaded)
    totals = []
    for turn in turns:
        other = "engine" if turn.role == "learner" else "learner"
        totals.append(turn.peak + resting[other])
        resting[turn.role] = turn.at_rest
    return totals


def device_peak(turns: list[Turn], loaded: dict[str, int]) -> int:
    return max(turn_totals(turns, loaded))


def summarise(mode: str, turns: list[Turn], loaded: dict[str, int]) -> ModeResult:
    def of(role: str) -> list[Turn]:
        return [turn for turn in turns if turn.role == role]

    totals = turn_totals(turns, loaded)
    generating = max(total for turn, total in zip(turns, totals, strict=True) if turn.role == "engine")
    return ModeResult(mode, max(t.peak for t in of("learner")), of("learner")[-1].at_rest,
                      max(t.peak for t in of("engine")), of("engine")[-1].at_rest, max(totals), generating)


# ------------------------------------------------------------------------------------------- memory readings
class _Meter:
    """Reserved bytes on a GPU, resident bytes on the CPU."""

    def __init__(self, device: str) -> None:
        self.device = device

    def start_turn(self) -> None:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def turn_peak(self) -> int:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_reserved()
        return self.now()

    def now(self) -> int:
        import psutil
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.memory_reserved()
        return psutil.Process().memory_info().rss


# --------------------------------------------------------------------------------------------- the two roles
def _learner(conn: Connection, model_path: str, device: str, colocated: bool, sizes: Sizes) -> None:
    from engines.training import TorchTrainer, TorchTrainerConfig
    from tools.gpu.check import synthetic_step

    samples, loss_fn = synthetic_step(sizes.train_samples, sizes.train_length)
    trainer = TorchTrainer(TorchTrainerConfig(
        model_path=model_path, lr=1e-5, device=device, dtype="bfloat16" if device == "cuda" else "float32",
        micro_batch_tokens=sizes.train_samples * sizes.train_length, check_packing=False,
        offload_optimizer=colocated))
    meter = _Meter(device)
    conn.send(meter.now())
    while conn.recv() == "turn":
        meter.start_turn()
        trainer.train_step(samples, loss_fn, temperature=1.0)
        conn.send(Turn("learner", meter.turn_peak(), meter.now()))
    trainer.close()


def _engine(conn: Connection, model_path: str, device: str, colocated: bool, sizes: Sizes) -> None:
    import asyncio

    import torch

    from engines.inference import GenerateRequest, SamplingParams, TorchEngine

    async def serve() -> None:
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        async with TorchEngine.from_pretrained(model_path, dtype=dtype, device=device, seed=0,
                                               max_batch_size=sizes.prompts,
                                               release_memory_when_idle=colocated) as engine:
            meter = _Meter(device)
            conn.send(meter.now())
            params = SamplingParams(temperature=1.0, max_new_tokens=sizes.new_tokens, ignore_eos=True)
            turn = 0
            while await asyncio.to_thread(conn.recv) == "turn":
                turn += 1
                meter.start_turn()
                releases = (await engine.health())["memory_releases"]
                await asyncio.gather(*(
                    engine.generate(GenerateRequest(f"t{turn}-{index}", [6 + (index + k) % 90 for k in
                                                                         range(sizes.prompt_length)], params))
                    for index in range(sizes.prompts)))
                if colocated:
                    await _wait_for_release(engine, releases)
                conn.send(Turn("engine", meter.turn_peak(), meter.now()))

    asyncio.run(serve())


async def _wait_for_release(engine: Any, before: int) -> None:
    import asyncio

    deadline = time.monotonic() + RELEASE_DEADLINE_S
    while (await engine.health())["memory_releases"] <= before:
        if time.monotonic() > deadline:
            raise TimeoutError(f"engine: no memory release within {RELEASE_DEADLINE_S:.0f} s of running out of work")
        await asyncio.sleep(0.01)


# ------------------------------------------------------------------------------------------------ the driver
def run_mode(colocated: bool, model_path: str, device: str, sizes: Sizes, rounds: int) -> ModeResult:
    """Both processes on `device`, `rounds` times: the engine generates, then the learner trains. On the CPU they
    are forked from this process, which imported what they run (`main`); a GPU's are new interpreters, since a
    process forked from one that asked CUDA anything cannot use it."""
    context = mp.get_context("fork" if device == "cpu" else "spawn")
    ends: dict[str, Connection] = {}
    processes = []
    for role, target in (("learner", _learner), ("engine", _engine)):
        ours, theirs = context.Pipe()
        process = context.Process(target=target, args=(theirs, model_path, device, colocated, sizes), daemon=True)
        process.start()
        ends[role] = ours
        processes.append(process)
    try:
        loaded = {role: _reply(conn, role, "loading") for role, conn in ends.items()}
        turns: list[Turn] = []
        for index in range(rounds):
            for role in ("engine", "learner"):
                ends[role].send("turn")
                turns.append(_reply(ends[role], role, f"turn {index + 1}"))
        for conn in ends.values():
            conn.send("stop")
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    return summarise("colocated" if colocated else "baseline: keeps its memory", turns, loaded)


def _reply(conn: Connection, role: str, what: str) -> Any:
    if not conn.poll(TURN_DEADLINE_S):
        raise TimeoutError(f"{role}: no reply to {what} within {TURN_DEADLINE_S:.0f} s")
    return conn.recv()


def print_table(results: list[ModeResult], device: str) -> None:
    unit = "GiB reserved" if device == "cuda" else "GiB resident (CPU: the machinery, not the saving)"
    print(f"\nColocated learner + engine on one {device} device, {unit}\n")
    header = (f"{'mode':28} {'learner peak':>13} {'learner rest':>13} {'engine peak':>12} {'engine rest':>12} "
              f"{'device peak':>12} {'while generating':>17}")
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r.mode:28} {_gib(r.learner_peak):>13} {_gib(r.learner_at_rest):>13} {_gib(r.engine_peak):>12} "
              f"{_gib(r.engine_at_rest):>12} {_gib(r.device_peak):>12} {_gib(r.generation_peak):>17}")
    base, colocated = results
    print(f"\ncolocated device peak: {colocated.device_peak / base.device_peak:.2f}x the baseline's; while the engine "
          f"generates: {colocated.generation_peak / base.generation_peak:.2f}x "
          f"({_gib(base.generation_peak - colocated.generation_peak)} GiB more left for its KV cache)")


def _gib(value: int) -> str:
    return f"{value / 2**30:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (resident set sizes; a smoke run)")
    parser.add_argument("--quick", action="store_true", help="the small model and sizes")
    parser.add_argument("--rounds", type=int, default=2, help="engine-then-learner turns per mode (default 2)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    from actors.runtime.logs import quiet_library_output

    quiet_library_output()  # before torch: the turns' processes inherit it, and their load bars stay off the table
    import torch

    from tools.gpu.check import gpu_model_spec
    from tools.standins.tiny_model import cached_tiny_model

    if args.cpu:
        # The turns' processes fork from here (run_mode) with both roles' modules imported, and torch on one thread
        # from before any op: a child forked after the OpenMP pool started hangs in its first parallel region
        # (tools/bench/forked.py).
        for module in ("engines.inference", "engines.training"):
            importlib.import_module(module)
        torch.set_num_threads(1)
    elif not torch.cuda.is_available():
        raise SystemExit("bench_colocate: no CUDA device here; use --cpu to run the turns on the CPU")
    device = "cpu" if args.cpu else "cuda"
    spec = gpu_model_spec(device, args.quick)
    model_path = str(cached_tiny_model(REPO / ".cache" / "models", spec))
    sizes = Sizes(8, 64, 8, 16, 32) if args.quick else Sizes(64, 256, 64, 64, 64)
    results = [run_mode(colocated, model_path, device, sizes, args.rounds) for colocated in (False, True)]
    print_table(results, device)
    if args.json is not None:
        args.json.write_text(json.dumps({"device": device, "sizes": asdict(sizes),
                                         "rows": [asdict(r) for r in results]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
