"""LoRA adapters in the SGLang-compatible server: SGLang's load-by-name contract over the torch engine's adapters.

SGLang keeps many adapters loaded and mixes their requests in one batch. So does this server: every loaded adapter
sits unmerged in a slot of the torch engine's named adapters (`engines/inference/multi_lora.py`), under its own
name, and a `/generate` item runs with the adapter its `lora_path` names beside rows of other adapters and of the
base model. A load writes the new adapter's slot only, between two decode steps, so requests of other adapters go
on untouched. What a client can observe is SGLang's contract, which is what the tests need:

* a request runs from its first token to its last with the adapter it named, and produces what a model with that
  adapter alone produces;
* an adapter loads from a PEFT folder (`adapter_config.json`, `adapter_model.safetensors`), and is refused,
  with SGLang's words, when its name is taken, or its rank or modules exceed `--max-lora-rank` and
  `--lora-target-modules`;
* a request that names an adapter that is not loaded fails with SGLang's message;
* an unload refuses new requests for the adapter at once and returns when the requests still using it are done
  (one of a name not loaded fails, with SGLang's message);
* `/v1/models` lists the base model and every adapter loaded (not one being unloaded), as SGLang's model cards.

Where it differs: SGLang keeps adapters beyond `--max-loras-per-batch` in host memory and swaps them in; here that
many are loaded at most, and a load past them is refused with a message saying so.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import math
from collections import Counter
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from safetensors.torch import load_file
from torch import Tensor

from engines.inference.base import GenerateOutput, GenerateRequest
from engines.sglang.protocol import LORA_ALL_MODULES, LORA_TARGET_MODULES
from engines.training.lora import PEFT_PREFIX
from tools.standins.sglang_server.parsing import request_json

logger = logging.getLogger("tools.standins.sglang_server")
NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


class AdapterError(ValueError):
    """A load, unload or request the server refuses; the message is SGLang's where SGLang has one."""


@dataclass(frozen=True)
class Adapter:
    """One loaded adapter, as the engine serves it: wire-named factors, B already multiplied by its scale."""

    name: str
    path: str
    rank: int
    modules: frozenset[str]  # the HF module paths it adapts
    factors: tuple[tuple[str, Tensor], ...]


def read_adapter(name: str, path: str) -> Adapter:
    """The PEFT folder at `path` as SGLang reads one: its config's `r`, `lora_alpha` (and rsLoRA), its weights."""
    folder = Path(path)
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
        weights = load_file(str(folder / WEIGHTS_FILE))
    except (OSError, ValueError) as error:
        raise AdapterError(f"Failed to load LoRA adapter {name} from {path}: {error}") from error
    if config.get("use_dora"):
        raise AdapterError(f"Failed to load {name} because LoRA serving currently doesn't support DoRA adapters")
    try:
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
    except (KeyError, TypeError, ValueError) as error:
        raise AdapterError(
            f"Failed to load LoRA adapter {name}: {CONFIG_FILE} lacks r or lora_alpha ({error})"
        ) from error
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    factors: list[tuple[str, Tensor]] = []
    for key, tensor in sorted(weights.items()):
        wire = key.removeprefix(PEFT_PREFIX)
        if wire.endswith(".lora_A.weight"):
            factors.append((wire, tensor.float()))
        elif wire.endswith(".lora_B.weight"):
            factors.append((wire, tensor.float() * scale))
        else:
            raise AdapterError(f"Failed to load LoRA adapter {name}: {WEIGHTS_FILE} holds {key!r}, not a lora_A or "
                               "lora_B weight")
    if not factors:
        raise AdapterError(f"Failed to load LoRA adapter {name}: {WEIGHTS_FILE} holds no adapter weights")
    modules = frozenset(wire.rsplit(".", 2)[0] for wire, _ in factors)
    ranks = {tensor.shape[0] for wire, tensor in factors if wire.endswith(".lora_A.weight")}
    return Adapter(name, path, max(ranks, default=rank), modules, tuple(factors))


class AdapterRegistry:
    """The loaded adapters, each served by the torch engine under its own name. `engine` is a TorchEngine built
    with `lora_scaling=1.0` (each adapter's B carries its own scale); `weight_shapes` maps a module path to its
    weight's (out, in), the layers an adapter may adapt."""

    def __init__(
        self,
        engine: Any,
        weight_shapes: dict[str, tuple[int, int]],
        *,
        max_rank: int,
        target_modules: Iterable[str],
        max_loaded: int,
    ) -> None:
        self.engine = engine
        self.weight_shapes = weight_shapes
        self.max_rank = max_rank
        self.target_modules = frozenset(target_modules)
        self.max_loaded = max_loaded
        self._adapters: dict[str, Adapter] = {}
        self._arriving: set[str] = set()  # names whose load is under way (not served yet)
        self._unloading: set[str] = set()  # unloaded, but still serving the requests that named them
        self._running: Counter[str] = Counter()
        self._changed = asyncio.Condition()

    @property
    def loaded(self) -> dict[str, str]:
        return {name: adapter.path for name, adapter in self._adapters.items()}

    async def load(self, name: str, path: str) -> None:
        if self._taken(name):
            raise AdapterError(f"Failed to load LoRA adapter {name} because it is already loaded")
        adapter = await asyncio.to_thread(read_adapter, name, path)
        suffixes = {module.rsplit(".", 1)[-1] for module in adapter.modules}
        allowed = set(LORA_TARGET_MODULES) if LORA_ALL_MODULES in self.target_modules else self.target_modules
        unknown = sorted(module for module in adapter.modules if module not in self.weight_shapes)
        if adapter.rank > self.max_rank or not suffixes <= allowed or unknown:
            raise AdapterError(
                f"LoRA adapter {name} with rank {adapter.rank} is incompatible with the current LoRA memory pool "
                "configuration. Please ensure that the LoRA adapter's rank is within the configured `--max-lora-rank` "
                "and that the target modules are included in `--lora-target-modules`."
                + (f" (the model has no layers {unknown[:3]})" if unknown else "")
            )
        if self._taken(name):  # loaded meanwhile by a concurrent call
            raise AdapterError(f"Failed to load LoRA adapter {name} because it is already loaded")
        held = len(self._adapters) + len(self._arriving) + len(self._unloading)
        if held >= self.max_loaded:
            raise AdapterError(f"Failed to load LoRA adapter {name}: this compatible server holds at most "
                               f"--max-loras-per-batch {self.max_loaded} adapters at once, and {held} are loaded "
                               f"({sorted(self._adapters)}, unloading {sorted(self._unloading)})")
        self._arriving.add(name)
        try:
            await self.engine.update_weights(list(adapter.factors), self.engine.version, adapter=name)
        except ValueError as error:
            raise AdapterError(f"Failed to load LoRA adapter {name} from {path}: {error}") from error
        finally:
            self._arriving.discard(name)
        self._adapters[name] = adapter  # served from now on: the engine holds it

    async def unload(self, name: str) -> None:
        """Refuse new requests for `name` now; return once the requests still using it are done."""
        if self._adapters.pop(name, None) is None:
            raise AdapterError(f"LoRA with name {name} does not exist. Loaded LoRAs: {self._adapters.keys()}")
        self._unloading.add(name)
        try:
            async with self._changed:
                await self._changed.wait_for(lambda: self._running[name] == 0)
            await self.engine.unload_adapter(name)
        finally:
            self._unloading.discard(name)
            self._running.pop(name, None)

    def _taken(self, name: str) -> bool:
        return name in self._adapters or name in self._arriving or name in self._unloading

    @contextlib.asynccontextmanager
    async def serving(self, name: str | None) -> AsyncIterator[None]:
        """Count a request of adapter `name` (None: the base model) as running while the body runs."""
        if name is None:
            yield
            return
        if name not in self._adapters:
            raise AdapterError(f"The following requested LoRA adapters are not loaded: {name}\n"
                               f"Loaded adapters: {sorted(self._adapters)}.")
        self._running[name] += 1
        try:
            yield
        finally:
            async with self._changed:
                self._running[name] -= 1
                self._changed.notify_all()


class AdapterRoutes:
    """The compatible server's LoRA routes. `registry` is None on a server started without `--enable-lora`."""

    def __init__(self, engine: Any, registry: AdapterRegistry | None, model: str = "") -> None:
        self.engine = engine
        self.registry = registry
        self.model = model  # the served model's name: --model-path, as SGLang's served_model_name defaults to

    @classmethod
    def for_server(cls, engine: Any, args: argparse.Namespace) -> AdapterRoutes:
        """The routes for a server started with `args`: adapters within `--max-lora-rank` on the model's layers."""
        if not args.enable_lora or engine is None:
            return cls(engine, None, args.model_path)
        shapes = {
            name.removesuffix(".weight"): (int(tensor.shape[0]), int(tensor.shape[1]))
            for name, tensor in engine.model.named_parameters()
            if name.endswith(".weight") and tensor.dim() == 2
        }
        return cls(engine, AdapterRegistry(engine, shapes, max_rank=args.max_lora_rank,
                                           target_modules=args.lora_target_modules,
                                           max_loaded=args.max_loras_per_batch), args.model_path)

    async def load(self, request: web.Request) -> web.Response:
        body = await request_json(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            return _failure("/load_lora_adapter: 'lora_name' and 'lora_path' must be non-empty strings")
        if self.registry is None:
            return _failure(NOT_ENABLED)
        try:
            await self.registry.load(name, path)
        except AdapterError as error:
            return _failure(str(error))
        logger.info("loaded LoRA adapter %s from %s", name, path)
        return web.json_response({"success": True, "error_message": None, "loaded_adapters": self.registry.loaded})

    async def unload(self, request: web.Request) -> web.Response:
        name = (await request_json(request)).get("lora_name")
        if not isinstance(name, str) or not name:
            return _failure("/unload_lora_adapter: 'lora_name' must be a non-empty string")
        if self.registry is None:
            return _failure(NOT_ENABLED)
        try:
            await self.registry.unload(name)
        except AdapterError as error:
            return _failure(str(error))
        return web.json_response({"success": True, "error_message": None, "loaded_adapters": self.registry.loaded})

    async def models(self, request: web.Request) -> web.Response:
        """SGLang's OpenAI-style `/v1/models`: the base model's card, then one per loaded adapter (its `root` the
        folder it was loaded from, its `parent` the base)."""
        cards = [{"id": self.model, "object": "model", "owned_by": "sglang", "root": self.model}]
        loaded = {} if self.registry is None else self.registry.loaded
        cards += [{"id": name, "object": "model", "owned_by": "sglang", "root": path, "parent": self.model}
                  for name, path in loaded.items()]
        return web.json_response({"object": "list", "data": cards})

    async def generate(self, adapter: str | None, request: GenerateRequest) -> list[GenerateOutput]:
        """`request` on the engine with the loaded adapter `adapter` (None: the base model)."""
        if self.registry is None:
            return await self.engine.generate(request)
        async with self.registry.serving(adapter):
            return await self.engine.generate(dataclasses.replace(request, adapter=adapter))


def _failure(message: str) -> web.Response:
    """SGLang's LoRA routes answer a `LoRAUpdateOutput`: success false and `error_message`, with HTTP 400."""
    logger.warning(message)
    return web.json_response({"success": False, "error_message": message, "loaded_adapters": None}, status=400)
