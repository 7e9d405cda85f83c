"""A rollout worker's engine endpoint without the rest of the worker: one torch engine in a process of its own,
served over the bus as a worker serves it to the others (`actors/rollout/engine_service.py`), so tests and
benchmarks can route calls over engines in real processes (and kill one mid-call) without starting a run.

    python -m tools.standins.engine_server --model PATH [--threads 1] [--prefix-cache-mb 1024] [--seed 0]

Prints one JSON line, `{"endpoint": "tcp://...", "pid": N}`, once it serves, and serves until it is terminated or
its standard input closes (the parent that started it went away).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="a local Hugging Face model folder")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--batch-size", type=int, default=64, help="sequences decoded together")
    parser.add_argument("--prefix-cache-mb", type=int, default=1024, help="the prefix cache's budget (0: none)")
    parser.add_argument("--seed", type=int, default=0, help="the engine's seed for unseeded requests")
    parser.add_argument("--version", type=int, default=0, help="the weight version the engine reports")
    return parser.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    import torch
    import zmq.asyncio

    from actors.rollout.engine_service import EngineService
    from bus.address import bind_address
    from engines.inference import TorchEngine

    torch.set_num_threads(args.threads)
    engine = TorchEngine.from_pretrained(args.model, max_batch_size=args.batch_size, seed=args.seed,
                                         version=args.version, prefix_cache_bytes=args.prefix_cache_mb << 20)
    context = zmq.asyncio.Context()
    service = EngineService(engine, zmq_context=context, bind=bind_address(args.host))
    serving = asyncio.ensure_future(service.serve())
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    loop.add_reader(sys.stdin.fileno(), lambda: stop.set() if not sys.stdin.buffer.read1(1 << 16) else None)
    print(json.dumps({"endpoint": service.endpoint, "pid": os.getpid()}), flush=True)
    await stop.wait()
    service.stop_serving()
    await engine.abort(None)
    await service.drain(1.0)
    service.close()
    serving.cancel()
    await engine.close()
    context.destroy(linger=0)


@dataclass
class EngineServer:
    """A started engine server: its process and the endpoint it serves on."""

    process: subprocess.Popen[str]
    endpoint: str

    @property
    def pid(self) -> int:
        return self.process.pid

    def kill(self) -> None:
        """kill -9, as a crash would end it."""
        self.process.kill()
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.process.stdin is not None:
            self.process.stdin.close()


def start(model: Path, *, threads: int = 1, prefix_cache_mb: int = 1024, seed: int = 0, version: int = 0,
          timeout: float = 120.0) -> EngineServer:
    """Start a server in a process of its own and wait (up to `timeout` seconds) for its endpoint."""
    command = [sys.executable, "-m", "tools.standins.engine_server", "--model", str(model), "--threads",
               str(threads), "--prefix-cache-mb", str(prefix_cache_mb), "--seed", str(seed), "--version",
               str(version)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryFile(mode="w+") as errors:  # read back only if it fails to start
        process = subprocess.Popen(command, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=errors, text=True)
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], timeout)
        line = process.stdout.readline() if ready else ""  # the first line is the endpoint; nothing else is printed
        if not line:
            process.kill()
            process.wait(timeout=30)
            errors.seek(0)
            raise RuntimeError(f"engine server on {model} did not start within {timeout:g} s (exit "
                               f"{process.returncode}):\n{errors.read()[-3000:]}")
    return EngineServer(process, json.loads(line)["endpoint"])


def start_all(model: Path, count: int, **options: Any) -> list[EngineServer]:
    """`count` servers started at once (each loads the model in its own process), seeds 0..count-1."""
    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(lambda index: start(model, **{"seed": index, **options}), range(count)))


def main(argv: list[str] | None = None) -> int:
    from actors.runtime.logs import quiet_library_output

    quiet_library_output()
    asyncio.run(serve(parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
