"""A rollout worker's engine and weight loader in a process of their own, for benchmarks that time real pushes."""

from __future__ import annotations

import asyncio
from typing import Any

import torch


def serve_pushes(model_path: str, spec: dict[str, Any], scaling: float | None, pushes: int) -> None:
    """Load `model_path` into a torch engine (LoRA merged at `scaling`, if given) and receive `pushes` versions
    of the group `spec` describes; one torch thread, as a worker beside a trainer on the same machine has."""
    from actors.runtime.logs import quiet_library_output
    from engines.inference import TorchEngine
    from engines.weights.torch_loader import TorchDistributedLoader

    quiet_library_output()
    torch.set_num_threads(1)

    async def serve() -> None:
        engine = TorchEngine.from_pretrained(model_path, lora_scaling=scaling)
        loader = TorchDistributedLoader(engine, "engine-0", Silent())
        try:
            for version in range(1, pushes + 1):
                await loader.apply(spec, version, timeout_s=600)
        finally:
            loader.close()
            await engine.close()

    asyncio.run(serve())


class Silent:
    """The loader's log, without a line per push in the benchmark's output."""

    def info(self, *args: Any, **fields: Any) -> None: ...

    warning = info
