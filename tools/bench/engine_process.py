"""A rollout worker's engine and weight loader in a process of their own, for benchmarks that time real pushes."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import torch

from tools.bench.forked import ForkedWorker


def serve_pushes(model_path: str, spec: dict[str, Any], scaling: float | None, pushes: int,
                 report_pauses: bool = False) -> None:
    """Load `model_path` into a torch engine (LoRA merged at `scaling`, if given) and receive `pushes` versions
    of the group `spec` describes; one torch thread, as a worker beside a trainer on the same machine has.
    `report_pauses`: print a JSON line per push, `{"version": v, "paused_ms": ms}`, what its generation waited."""
    from actors.runtime.logs import quiet_library_output
    from engines.inference import TorchEngine
    from engines.weights.torch_loader import TorchDistributedLoader

    quiet_library_output()
    torch.set_num_threads(1)

    async def serve() -> None:
        engine = TorchEngine.from_pretrained(model_path, lora_scaling=scaling)
        loader = TorchDistributedLoader(engine, "engine-0", Pauses() if report_pauses else Silent())
        try:
            for version in range(1, pushes + 1):
                await loader.apply(spec, version, timeout_s=600)
        finally:
            loader.close()
            await engine.close()

    asyncio.run(serve())


def forked_engine(errors: Path) -> ForkedWorker:
    """`serve_pushes` in a worker forked now (before the benchmark's first torch op, or with torch on one thread:
    tools/bench/forked.py), told later by `order_pushes` what to load and which group to join."""
    return ForkedWorker(lambda: serve_pushes(**json.loads(sys.stdin.readline())), errors)


def order_pushes(engine: ForkedWorker, model_path: str, spec: dict[str, Any], scaling: float | None,
                 pushes: int, report_pauses: bool = False) -> None:
    engine.stdin.write(json.dumps({"model_path": model_path, "spec": spec, "scaling": scaling,
                                   "pushes": pushes, "report_pauses": report_pauses}) + "\n")
    engine.close_stdin()


class Silent:
    """The loader's log, without a line per push in the benchmark's output."""

    def info(self, *args: Any, **fields: Any) -> None: ...

    warning = info


class Pauses(Silent):
    """The loader's log, reduced to how long each push paused generation, one JSON line per push on stdout."""

    def info(self, *args: Any, **fields: Any) -> None:
        if args == ("weights loaded",):
            print(json.dumps({"version": fields["version"], "paused_ms": fields["paused_ms"]}), flush=True)


def read_pauses(engine: ForkedWorker) -> dict[int, float]:
    """The pauses a finished `report_pauses` engine printed, in seconds by version."""
    pauses = {}
    for line in engine.stdout:
        record = json.loads(line)
        pauses[record["version"]] = record["paused_ms"] / 1000
    return pauses
