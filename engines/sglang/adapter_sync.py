"""A LoRA run's weight sync to SGLang servers: the adapter travels, and the server loads it by name.

A LoRA run changes only the adapter, tens of megabytes where the model is gigabytes, so only the adapter moves.
SGLang serves adapters by name (`/load_lora_adapter` from a PEFT folder; a `/generate` item names its adapter in
`lora_path`), so every load gets a name of its own: `slipstream-v<version>-<6 hex digits>`, or in a run of several
policies `slipstream-<policy>-v<version>-<6 hex digits>`. The random part keeps names unique when a version is
pushed twice (a push retried after another engine failed, a learner resumed from a checkpoint) and across
rollout-worker restarts attached to the same server: SGLang refuses to load a name twice.

In a run of several policies each policy's learner pushes its own adapter (`WeightUpdateOrder.adapter`, the
policy), and the worker keeps a loader per learner (`actors/rollout/weights.py`), so each policy's versions are
written, loaded and retired on their own: a load of one policy's adapter neither waits for nor touches the
requests of another's.

1. The learner broadcasts the adapter's tensors to the rollout workers over gloo (the bucketed broadcast of
   `engines/weights/torch_distributed.py`, with its versions, readiness and acknowledgements). The rollout
   worker is the receiver here, not the server: the bytes are few, and a gloo receive in the worker needs no
   GPU memory next to SGLang's.
2. The worker writes them as a PEFT adapter folder (`adapter_config.json`, `adapter_model.safetensors`) under
   its own directory on the server's machine, and asks its server to load that folder under the load's name.
   Only then does it acknowledge, so a committed version is one every server serves.
3. Requests of the policy sent from then on name the new adapter; requests in flight finish with the one they
   named (SGLang holds an adapter while a request uses it), so all of a response's tokens come from one version,
   and nothing is paused or aborted. The policy's previous adapter is unloaded in the background once no request
   uses it, and its folder is deleted.

Why a folder, not `/load_lora_adapter_from_tensors`: that endpoint takes tensors pickled with torch's
multiprocessing reductions (shared-memory or CUDA IPC handles), which only a process on the server's host that
keeps the tensors alive can hand over, in a format SGLang treats as internal. A folder is the form both supported
releases load, the one `--lora-paths` takes; written to a local disk, a few tens of megabytes cost milliseconds.

The server must be started with LoRA enabled and room for the adapter: `--enable-lora --max-lora-rank R
--lora-target-modules ...` (the rollout worker adds these to a server it launches; an attached server needs
them on its own command line, and a missing one fails the first push with SGLang's message).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from engines.sglang.adapter_endpoints import AdapterServing
from engines.sglang.client import SglangEngine
from engines.training.lora import PEFT_PREFIX, WIRE_SUFFIXES
from engines.weights.torch_loader import TorchDistributedLoader

ADAPTER_PREFIX = "slipstream-v"
UNLOAD_TIMEOUT_S = 3600.0  # an old adapter waits for its longest request; SGLang's own request timeout is an hour


def adapter_name(version: int, policy: str | None = None) -> str:
    """A fresh name for a load of `version` of `policy`'s adapter (None: a run of one policy; module docstring)."""
    prefix = ADAPTER_PREFIX if policy is None else f"slipstream-{policy}-v"
    return f"{prefix}{version}-{secrets.token_hex(3)}"


def write_adapter_folder(tensors: Mapping[str, Tensor], alpha: float, folder: Path) -> None:
    """`tensors` (wire names `<module>.lora_A.weight` / `.lora_B.weight`) as a PEFT adapter folder.

    The rank is the tensors' own; the target modules are the module names the tensors adapt. Written to a
    temporary name first and renamed, so a reader never sees half a folder."""
    from safetensors.torch import save_file

    ranks = {int(tensor.shape[0]) for name, tensor in tensors.items() if name.endswith(".lora_A.weight")}
    if len(ranks) != 1:
        raise ValueError(f"an adapter needs lora_A tensors of one rank, got ranks {sorted(ranks)} "
                         f"({len(tensors)} tensors)")
    unknown = sorted(name for name in tensors if not name.endswith(WIRE_SUFFIXES))
    if unknown:
        raise ValueError(f"{unknown[:3]} are not LoRA adapter tensors: a LoRA run pushes lora_A and lora_B only")
    modules = sorted({name.rsplit(".", 3)[-3] for name in tensors})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": ranks.pop(),
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": modules,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "base_model_name_or_path": None,
    }
    staging = folder.with_name(folder.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    payload = {PEFT_PREFIX + name: tensor.contiguous() for name, tensor in tensors.items()}
    save_file(payload, str(staging / "adapter_model.safetensors"))
    (staging / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)


class SglangAdapterLoader(TorchDistributedLoader):
    """A rollout worker's end: receive the adapter, write its folder, have the server load it, acknowledge."""

    def __init__(self, engine: SglangEngine, actor_id: str, log: Any) -> None:
        super().__init__(engine, actor_id, log)
        if engine.adapters is None:
            raise ValueError(f"{actor_id}: adapter updates need an SglangEngine built with "
                             "adapters=AdapterServing(...) (the run's lora_alpha)")
        self.serving: AdapterServing = engine.adapters
        self._root: Path | None = None
        self._unloads: set[asyncio.Task[None]] = set()

    @property
    def root(self) -> Path:
        """This worker's own directory of adapter folders, made on first use."""
        if self._root is None:
            base = self.serving.folder
            if base is not None:
                Path(base).mkdir(parents=True, exist_ok=True)
            self._root = Path(tempfile.mkdtemp(prefix=f"slipstream-lora-{self.actor_id}-", dir=base))
        return self._root

    async def _receive(self, receiver: Any, version: int, timeout_s: float, adapter: str | None = None) -> int:
        """`adapter`: the policy whose adapter the push is (None: a run of one policy), loaded under a name of the
        policy and the version."""
        loop = asyncio.get_running_loop()
        received: dict[str, Tensor] = {}

        def collect(named: Iterable[tuple[str, Tensor]]) -> None:
            for name, tensor in named:  # views of a receive buffer that is reused: copy
                received[name] = tensor.detach().clone()

        def serve(number: int) -> None:
            name = adapter_name(number, adapter)
            folder = self.root / name
            write_adapter_folder(received, self.serving.alpha, folder)
            try:
                load = self.engine.load_adapter(name, str(folder), number, policy=adapter, timeout=timeout_s)
                asyncio.run_coroutine_threadsafe(load, loop).result()
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)
                raise

        previous = self.engine.adapter_name(adapter)
        number = await asyncio.to_thread(receiver.receive, collect, timeout_s, finish_fn=serve)
        loaded = self.engine.adapter_name(adapter)
        if previous is not None and previous != loaded:
            task = asyncio.create_task(self._retire(previous))
            self._unloads.add(task)
            task.add_done_callback(self._unloads.discard)
        if adapter is None:
            self.log.info("adapter loaded by the SGLang server", version=number, adapter=loaded, tensors=len(received))
        else:
            self.log.info("adapter loaded by the SGLang server", version=number, adapter=loaded, tensors=len(received),
                          policy=adapter)
        return number

    async def _retire(self, name: str) -> None:
        try:
            await self.engine.unload_adapter(name, timeout=UNLOAD_TIMEOUT_S)
        except Exception as error:  # the server restarted or went away: the adapter went with it
            self.log.warning("adapter not unloaded", adapter=name, error=str(error))
        shutil.rmtree(self.root / name, ignore_errors=True)

    def close(self) -> None:
        super().close()
        for task in self._unloads:
            task.cancel()
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None
