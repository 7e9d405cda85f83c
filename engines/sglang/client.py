"""`SglangEngine`: the `InferenceEngine` interface over an SGLang server's HTTP API.

Generation is `/generate` with token ids in and `return_logprob`, one HTTP call per request (a batch of
one-sample items when `n > 1`, see `protocol.py`). Token ids and log-probs come from
`meta_info.output_token_logprobs`, the finish reason from `meta_info.finish_reason`.

Versions: SGLang tags a whole response with one `weight_version`, the server's version when the response was
built, not per token. A weight update may have landed during the request, so that number can be newer than
some of the tokens. Staleness is measured from the oldest token version, so every token of a response is
tagged with the smaller of (the version this client knew the server had when the request started, the reported
one). That overestimates the staleness of tokens produced after a mid-request update and never underestimates
it.

Failures: a request the server aborts returns its partial output with finish reason "abort", like the torch
engine. A server that dies takes its in-flight requests with it: they return empty outputs marked "abort"
(the rollout worker treats them like any aborted sample). When this engine launched the server
(`ServerProcess`), a health loop restarts it after a failed check, counts the restart and resets the known
version to 0, because a restarted server serves the initial checkpoint until the learner's next push.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from typing import Any

import aiohttp
import torch

from engines.inference.base import PAUSE_MODES, GenerateOutput, GenerateRequest, InferenceEngine, PauseMode
from engines.sglang import protocol
from engines.sglang.launch import ServerProcess

logger = logging.getLogger(__name__)

# Our "keep" is SGLang's "retract": in-flight requests wait in the queue and are re-prefilled after
# continue_generation, which lets a weight update flush the KV cache (SGLang refuses to flush in "in_place").
PAUSE_MODE_ON_WIRE = {"abort": "abort", "keep": "retract"}


class SglangError(RuntimeError):
    """An SGLang endpoint failed; the message names the URL, the endpoint and what the server said."""


class SglangEngine(InferenceEngine):
    """One SGLang server. `server` is given when this engine launched it (then it restarts and stops it)."""

    def __init__(
        self,
        url: str,
        *,
        server: ServerProcess | None = None,
        request_timeout: float = 3600.0,
        control_timeout: float = 120.0,
        health_interval: float = 2.0,
        health_failures_before_restart: int = 3,
        stop_grace_s: float = 1.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.server = server
        self.request_timeout = request_timeout
        self.control_timeout = control_timeout
        self.health_interval = health_interval
        self.health_failures_before_restart = health_failures_before_restart
        self.stop_grace_s = stop_grace_s
        self.restarts = 0
        self.failed_requests = 0
        self._version = 0
        self._session: aiohttp.ClientSession | None = None
        self._inflight: dict[str, list[str]] = {}
        self._health_task: asyncio.Task[None] | None = None
        self._restarting: asyncio.Task[None] | None = None
        self._closed = False

    # ---- InferenceEngine

    @property
    def version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        """Record the version the server now serves (called after a weight update it acknowledged)."""
        self._version = version

    async def generate(self, request: GenerateRequest) -> list[GenerateOutput]:
        self._require_open()
        self._ensure_health_loop()
        if request.request_id in self._inflight:
            raise ValueError(f"request {request.request_id!r} is already in flight on {self.url}")
        if self._restarting is not None:  # requests wait for the server instead of failing meanwhile
            with contextlib.suppress(Exception):  # a failed restart shows as this request's connection failure
                await asyncio.shield(self._restarting)
        rids = protocol.wire_request_ids(request)
        started_version = self._version
        self._inflight[request.request_id] = rids
        try:
            body = await self._post_generate(request)
        except asyncio.CancelledError:
            # Free the server's slots: the abort must outlive this cancelled task.
            asyncio.get_running_loop().create_task(self._abort_rids(rids))
            raise
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError, TimeoutError) as error:
            self.failed_requests += 1
            logger.warning(
                "%s/generate failed (%r); request %s returns as aborted", self.url, error, request.request_id
            )
            return [_aborted(request, index) for index in range(request.params.n)]
        finally:
            self._inflight.pop(request.request_id, None)
        items = body if isinstance(body, list) else [body]
        if len(items) != request.params.n:
            raise SglangError(f"{self.url}/generate returned {len(items)} outputs for n={request.params.n}")
        outputs = []
        for index, item in enumerate(items):
            parsed = protocol.parse_output_json(item, where=f"{self.url}/generate output {index}")
            version = started_version if parsed.weight_version is None else min(started_version, parsed.weight_version)
            outputs.append(
                GenerateOutput(
                    request_id=request.request_id,
                    output_ids=parsed.output_ids,
                    log_probs=parsed.log_probs,
                    versions=[version] * len(parsed.output_ids),
                    finish_reason=parsed.finish_reason,
                    sample_index=index,
                    prompt_len=len(request.input_ids),
                    matched_stop=parsed.matched_stop,
                )
            )
        return outputs

    async def abort(self, request_id: str | None = None) -> None:
        self._require_open()
        if request_id is None:
            await self._post("/abort_request", {"rid": "", "abort_all": True})
            return
        rids = self._inflight.get(request_id)
        if rids:
            await self._abort_rids(rids)

    async def pause(self, mode: PauseMode = "keep") -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self._require_open()
        await self._post("/pause_generation", {"mode": PAUSE_MODE_ON_WIRE[mode]})

    async def resume(self) -> None:
        self._require_open()
        await self._post("/continue_generation", {})

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        raise NotImplementedError(
            f"{self.url}: an SGLang server receives weights by broadcast (/update_weights_from_distributed, "
            "driven by engines.sglang.weights.SglangWeightLoader), not as tensors handed to the client"
        )

    async def health(self) -> dict[str, object]:
        healthy = not self._closed and await self._healthy(timeout=5.0)
        return {
            "engine": "sglang",
            "url": self.url,
            "healthy": healthy,
            "version": self._version,
            "restarts": self.restarts,
            "requests": len(self._inflight),
            "failed_requests": self.failed_requests,
        }

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in (self._health_task, self._restarting):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self._session is not None:
            await self._session.close()
        if self.server is not None:
            # Short grace: callers bound their shutdown (the rollout worker's is 2 s), and the server keeps nothing
            # worth a graceful exit; SIGKILL of its process group frees its memory all the same.
            await asyncio.to_thread(self.server.stop, self.stop_grace_s)

    # ---- SGLang endpoints beyond the interface (used by the weight loader)

    async def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout: float,
    ) -> None:
        await self._post(
            "/init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
            timeout=timeout,
        )

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self._post("/destroy_weights_update_group", {"group_name": group_name})

    async def update_weights_from_distributed(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str,
        flush_cache: bool,
        timeout: float,
    ) -> None:
        await self._post(
            "/update_weights_from_distributed",
            {
                "names": names,
                "dtypes": dtypes,
                "shapes": shapes,
                "group_name": group_name,
                "weight_version": weight_version,
                "flush_cache": flush_cache,
            },
            timeout=timeout,
        )

    async def flush_cache(self) -> None:
        await self._post("/flush_cache", None)

    async def server_weight_version(self) -> int | None:
        body = await self._get_json("/get_weight_version")
        return protocol.parse_weight_version(body.get("weight_version"))

    async def sync_version(self) -> int:
        """Adopt the server's own weight version (when attaching to a server that may already be updated)."""
        version = await self.server_weight_version()
        self._version = version if version is not None else 0
        return self._version

    # ---- HTTP

    async def _post_generate(self, request: GenerateRequest) -> Any:
        session = self._client()
        timeout = aiohttp.ClientTimeout(total=self.request_timeout)
        async with session.post(
            self.url + "/generate", json=protocol.generate_json(request), timeout=timeout
        ) as reply:
            if reply.status != 200:
                raise SglangError(
                    f"{self.url}/generate: HTTP {reply.status} for request {request.request_id!r}: "
                    f"{(await reply.text())[:500]}"
                )
            return await reply.json(content_type=None)

    async def _post(self, path: str, body: dict[str, Any] | None, *, timeout: float | None = None) -> Any:
        session = self._client()
        limit = aiohttp.ClientTimeout(total=timeout or self.control_timeout)
        try:
            async with session.post(self.url + path, json=body, timeout=limit) as reply:
                text = await reply.text()
                if reply.status != 200:
                    raise SglangError(f"{self.url}{path}: HTTP {reply.status}: {text[:500]}")
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            raise SglangError(f"{self.url}{path}: {type(error).__name__}: {error}") from error
        return _json_or_text(text, f"{self.url}{path}")

    async def _get_json(self, path: str) -> dict[str, Any]:
        session = self._client()
        try:
            async with session.get(
                self.url + path, timeout=aiohttp.ClientTimeout(total=self.control_timeout)
            ) as reply:
                if reply.status != 200:
                    raise SglangError(f"{self.url}{path}: HTTP {reply.status}: {(await reply.text())[:500]}")
                body = await reply.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            raise SglangError(f"{self.url}{path}: {type(error).__name__}: {error}") from error
        if not isinstance(body, dict):
            raise SglangError(f"{self.url}{path}: expected a JSON object, got {str(body)[:200]!r}")
        return body

    async def _abort_rids(self, rids: list[str]) -> None:
        for rid in rids:
            with contextlib.suppress(SglangError):
                await self._post("/abort_request", {"rid": rid})

    async def _healthy(self, timeout: float) -> bool:
        try:
            async with self._client().get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=timeout)) as reply:
                return reply.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    def _client(self) -> aiohttp.ClientSession:
        # Created on first use, inside the loop that uses it (the engine itself may be built in a worker thread).
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self._session

    def _require_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"SGLang engine for {self.url} is closed")

    # ---- health loop (only for a server this engine launched)

    def _ensure_health_loop(self) -> None:
        if self.server is not None and self._health_task is None:
            self._health_task = asyncio.get_running_loop().create_task(self._watch_health())

    async def _watch_health(self) -> None:
        failures = 0
        while not self._closed:
            await asyncio.sleep(self.health_interval)
            assert self.server is not None
            if self.server.alive() and await self._healthy(timeout=max(self.health_interval, 5.0)):
                failures = 0
                continue
            failures += 1
            if self.server.alive() and failures < self.health_failures_before_restart:
                continue
            failures = 0
            self._restarting = asyncio.get_running_loop().create_task(self._restart())
            try:
                await self._restarting
            except Exception as error:  # a failed start is retried at the next check, never fatal to the worker
                logger.error("restarting SGLang server %s failed: %s", self.url, error)
            finally:
                self._restarting = None

    async def _restart(self) -> None:
        assert self.server is not None
        logger.warning(
            "SGLang server %s failed its health check; restarting it (restart %d)", self.url, self.restarts + 1
        )
        url = await asyncio.to_thread(self.server.restart)
        self.url = url.rstrip("/")
        self.restarts += 1
        self._version = 0
        logger.warning(
            "SGLang server restarted at %s; serving the initial checkpoint until the next weight push", self.url
        )


def _aborted(request: GenerateRequest, index: int) -> GenerateOutput:
    return GenerateOutput(
        request_id=request.request_id,
        output_ids=[],
        log_probs=[],
        versions=[],
        finish_reason="abort",
        sample_index=index,
        prompt_len=len(request.input_ids),
    )


def _json_or_text(text: str, where: str) -> Any:
    import json

    if not text:
        return None
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return text
    if isinstance(body, dict) and body.get("success") is False:
        raise SglangError(f"{where}: {body.get('message')}")
    return body
