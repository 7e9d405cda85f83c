"""The compatible server's colocation routes: weights by reference, and memory released and resumed by tag.

SGLang (`--enable-memory-saver`) frees the GPU memory a tag names (`weights`, `kv_cache`, `cuda_graph`) on
`/release_memory_occupation` and maps it again on `/resume_memory_occupation`; released weights come back with
their old contents only with `--enable-weights-cpu-backup`, else they hold whatever the memory held. On a CPU
there is no device memory to hand over, so this stand-in keeps what a client can get wrong, loudly:

* a release while requests run is refused, as SGLang's scheduler asserts the server is idle;
* resuming a tag that is not released is refused (SGLang's scheduler would fail removing it from its set);
* while `kv_cache` or `weights` is released `/generate` is refused, and while `weights` is, every weight
  update, where SGLang would touch unmapped memory;
* weights resumed without a backup are NaN, so a run that generates with them cannot pass for a correct one.

`/update_weights_from_tensor` opens the handles of `tensor_payload.py` (entry 0: this server is one rank) and
loads them like a received bucket, inside a weight-update session where the served release has them.
"""

from __future__ import annotations

import argparse
import asyncio
import math
from typing import Any, Protocol

import torch
from aiohttp import web

from engines.inference.torch_engine import TorchEngine
from engines.sglang import protocol
from engines.sglang.tensor_payload import PayloadError, decode_named_tensors
from tools.standins.sglang_server import parsing


class Server(Protocol):
    """What these routes use of the compatible server (`server.py: CompatServer`)."""

    engine: TorchEngine
    sessions: bool
    session_open: bool
    weights_lock: asyncio.Lock

    async def idle(self) -> bool: ...

    async def load(self, tensors: list[tuple[str, Any]], version: Any) -> web.Response | None: ...

    async def flush_after_update(self, body: dict[str, Any]) -> web.Response: ...


class ColocationRoutes:
    def __init__(self, server: Server, args: argparse.Namespace) -> None:
        self.server = server
        self.cpu_backup = bool(getattr(args, "enable_weights_cpu_backup", False))
        self.released: set[str] = set()
        self._backup: list[tuple[str, torch.Tensor]] | None = None

    def refusal(self, what: str, needs: tuple[str, ...] = (protocol.MEMORY_WEIGHTS, protocol.MEMORY_KV_CACHE)
                ) -> web.Response | None:
        """Why `what` cannot run now (memory it `needs` is released), as SGLang's shape of a failed call."""
        gone = sorted(self.released & set(needs))
        if not gone:
            return None
        return _refused(f"{what}: the server's {', '.join(gone)} memory is released; call "
                        f"{protocol.RESUME_MEMORY.path} first")

    async def release(self, request: web.Request) -> web.Response:
        tags = await self._tags(request)
        if isinstance(tags, web.Response):
            return tags
        if not await self.server.idle():
            return _failure("release_memory_occupation should be called only when server is idle.")
        if protocol.MEMORY_WEIGHTS in tags and protocol.MEMORY_WEIGHTS not in self.released and self.cpu_backup:
            self._backup = self.server.engine.weights_snapshot()
        self.released |= set(tags)
        return web.json_response(None)

    async def resume(self, request: web.Request) -> web.Response:
        tags = await self._tags(request)
        if isinstance(tags, web.Response):
            return tags
        missing = sorted(set(tags) - self.released)
        if missing:
            return _failure(f"resume_memory_occupation: {missing} not released (SGLang's scheduler fails removing "
                            "a tag it does not hold)")
        if protocol.MEMORY_WEIGHTS in tags:
            engine = self.server.engine
            restored = self._backup or [(name, torch.full_like(t, math.nan)) for name, t in engine.weights_snapshot()]
            await engine.update_weights(restored, engine.version)
            self._backup = None
        self.released -= set(tags)
        return web.json_response(None)

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        server = self.server
        body = await parsing.request_json(request)
        payloads = body.get("serialized_named_tensors")
        if not isinstance(payloads, list) or not payloads or not all(isinstance(p, str) for p in payloads):
            return _refused("/update_weights_from_tensor: serialized_named_tensors must be a list of base64 strings, "
                            "one per tensor-parallel rank")
        if body.get("load_format") is not None:
            return _refused(f"/update_weights_from_tensor: load_format {body['load_format']!r} is not supported; "
                            "send (name, tensor) pairs (load_format omitted)")
        if server.sessions and not server.session_open:
            return _refused("update_weights_from_tensor must run between begin_weight_update() and "
                            "end_weight_update()")
        refused = self.refusal("update_weights_from_tensor", needs=(protocol.MEMORY_WEIGHTS,))
        if refused is not None:
            return refused
        async with server.weights_lock:
            try:
                named = decode_named_tensors(payloads[0])
            except PayloadError as error:
                return _refused(str(error))
            if body.get("abort_all_requests"):
                await server.engine.abort(None)
            refused = await server.load(named, body.get("weight_version"))
            del named  # the learner's memory: the engine copied what it needs
            if refused is not None:
                return refused
        return await server.flush_after_update(body)

    async def _tags(self, request: web.Request) -> list[str] | web.Response:
        tags = (await parsing.request_json(request)).get("tags")
        if tags is None or tags == []:
            return list(protocol.MEMORY_TAGS)  # SGLang's default: every type
        if not isinstance(tags, list) or any(tag not in protocol.MEMORY_TAGS for tag in tags):
            return _failure(f"tags {tags!r}: expected a list of {list(protocol.MEMORY_TAGS)}")
        return list(tags)


def _failure(message: str) -> web.Response:
    """SGLang's answer when a memory call raised (`_create_error_response`)."""
    return web.json_response({"error": {"message": message}}, status=400)


def _refused(message: str) -> web.Response:
    """SGLang's answer to a failed weight update: success false and the reason."""
    return web.json_response({"success": False, "message": message}, status=400)
