"""`SglangEngine`: the `InferenceEngine` interface over an SGLang server's HTTP API.

Generation is `/generate` with token ids in and `return_logprob`, one HTTP call per request (a batch of
one-sample items when `n > 1`, see `protocol.py`). Token ids and log-probs come from
`meta_info.output_token_logprobs`, the finish reason from `meta_info.finish_reason`. Every endpoint is called
through its row of `protocol.ENDPOINTS`, the table the contract tests check against SGLang's source.

Versions: SGLang 0.5.23 says which weights produced each token (`meta_info.weight_versions` spans), and those
are used as they are. Older releases tag a whole response with one `weight_version`, the server's version when
the response was built; a weight update may have landed during the request, so that number can be newer than
some of the tokens. Staleness is measured from the oldest token version, so then every token of a response is
tagged with the smaller of (the version this client knew the server had when the request started, the reported
one), which overestimates the staleness of tokens produced after a mid-request update and never underestimates
it.

LoRA: in a run that trains an adapter, the server serves the base model plus the adapter versions the weight
loader loads by name (`adapter_sync.py`). Every request names the newest loaded adapter of its policy in
`lora_path` (a run of several policies has one adapter per policy, and a request names its policy in
`GenerateRequest.adapter`; a run of one has one), and SGLang keeps that adapter for the request's whole life (an
unload waits for it), so all of a response's tokens come from that one version, which tags them; the server's own
`weight_version` is the base model's and says nothing here.

Pausing: every pause goes on the wire as SGLang's "abort" mode (slime's choice). "retract" keeps requests in
the scheduler's queue, and then SGLang 0.5.15 cannot flush its cache after a weight update (its weight updater
asserts the flush succeeded and the scheduler takes the server down), while 0.5.23 fails the update instead.
Our interface's "keep" (requests hold their state and continue after `resume`) is kept by this client: a
request the server returns as aborted while a "keep" pause was in effect is resumed here, as a continuation
(prompt + the tokens so far, the remaining budget, see `continuation_request`), and the caller receives one
output whose tokens carry their own log-probs and versions. Requests sent while the server is paused wait in the
server, as they do on SGLang.

Context length (`/server_info`): as in the torch engine, a prompt that leaves no room is a ValueError naming the
request, and `max_new_tokens` is clamped to the room left, so SGLang never answers HTTP 400 for a long prompt.

Failures: a request the server aborts (outside a "keep" pause) returns its partial output with finish reason
"abort", like the torch engine. A server that dies takes its in-flight requests with it: they return empty
outputs marked "abort" (the rollout worker treats them like any aborted sample). When this engine launched the
server (`ServerProcess`), a health loop restarts it after failed checks, counts the restart and resets the known
version to 0 (a restarted server serves the initial checkpoint until the next push). While generation is paused,
or a colocated server's memory released, the loop checks only `/model_info`: SGLang's `/health` generates a token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import numpy as np
import torch

from engines.inference.base import (
    ContextFull,
    GenerateOutput,
    GenerateRequest,
    InferenceEngine,
    PauseMode,
    RoutedExperts,
    check_pause_mode,
    continuation_request,
)
from engines.sglang import protocol
from engines.sglang.adapter_endpoints import AdapterEndpoints, AdapterServing
from engines.sglang.errors import SglangError
from engines.sglang.launch import ServerProcess
from engines.sglang.memory_endpoints import MemoryTurns
from engines.sglang.protocol import Endpoint
from engines.sglang.weight_endpoints import WeightUpdateEndpoints

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerLimits:
    """What `/server_info` says about request sizes (and seeding), as far as the server reports it.

    `context_length`: prompt + new tokens must fit in it (SGLang refuses more with HTTP 400).
    `input_limit`: a prompt must be shorter than this (SGLang refuses a prompt of `context_length` tokens or
    more, and its scheduler aborts one of `max_req_input_len` or more).
    """

    context_length: int | None
    input_limit: int | None
    deterministic: bool | None
    loras_per_batch: int | None = None  # --max-loras-per-batch, --max-loaded-loras: the room for LoRA adapters
    loaded_loras: int | None = None

    @classmethod
    def from_server_info(cls, info: dict[str, Any]) -> ServerLimits:
        context, max_input = _positive_int(info.get("context_length")), _positive_int(info.get("max_req_input_len"))
        if context is None and max_input is not None:
            # SGLang sets max_req_input_len = min(context_len - 1, kv_capacity - 1) - 5 (tp_worker.py), so this
            # is a lower bound of the context length when the server does not report it (0.5.15 reports only a
            # --context-length given on its command line).
            context = max_input + 6
        limits = [value for value in (context, max_input) if value is not None]
        deterministic = info.get("enable_deterministic_inference")
        deterministic = deterministic if isinstance(deterministic, bool) else None
        return cls(context, min(limits) if limits else None, deterministic,
                   _positive_int(info.get("max_loras_per_batch")), _positive_int(info.get("max_loaded_loras")))


@dataclass
class _Flight:
    """One `generate` call in flight: the wire rids its segments occupy now, and how it may end."""

    rids: set[str] = field(default_factory=set)
    caller_aborted: bool = False  # abort(id), abort(None) or pause("abort"): the caller wants the partial output
    lost: bool = False  # the server went away: nothing to resume on


class SglangEngine(WeightUpdateEndpoints, AdapterEndpoints, MemoryTurns, InferenceEngine):
    """One SGLang server. `server` is given when this engine launched it (then it restarts and stops it);
    `release_tags`, the memory it hands over when idle (a colocated run's, `memory_endpoints.py`)."""

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
        adapters: AdapterServing | None = None,
        release_tags: Iterable[str] = (),
        moe_routes: MoeRoutes | None = None,
    ) -> None:
        """`moe_routes`: how the served model's routes are shaped, to ask for and return each token's routed
        experts (routing replay; the server must run with --enable-return-routed-experts)."""
        self.url = url.rstrip("/")
        self.moe_routes = moe_routes
        self.adapters = adapters  # set in a LoRA run: how the weight loader writes adapter versions for the server
        self.server = server
        self.request_timeout = request_timeout
        self.control_timeout = control_timeout
        self.health_interval = health_interval
        self.health_failures_before_restart = health_failures_before_restart
        self.stop_grace_s = stop_grace_s
        self.restarts = self.failed_requests = 0
        self.resumed_requests = 0  # continuations sent for samples a "keep" pause aborted
        self._version = 0
        self._session: aiohttp.ClientSession | None = None
        self._inflight: dict[str, _Flight] = {}
        self._health_task: asyncio.Task[None] | None = None
        self._restarting: asyncio.Task[None] | None = None
        self._closed = False
        self._paused = False
        self._keep_paused = False
        self._keep_epoch = 0  # counts "keep" pauses: an abort that came back across one was caused by it
        self._limits: ServerLimits | None = None
        self._limits_lock = asyncio.Lock()
        self._sessions: bool | None = None  # whether the server has weight-update sessions (None: not known yet)
        self._warned_seed = False
        self._served: dict[str | None, tuple[str, int]] = {}  # per policy: the adapter its requests run with
        self._left: set[str] = set()  # policies that left the run (stop_serving): their requests are refused
        self._adapter_users: Counter[str] = Counter()  # requests in flight per adapter name
        self._adapter_released: asyncio.Condition | None = None  # made in the loop that uses it
        self._init_memory_turns(release_tags)

    # ---- InferenceEngine

    @property
    def version(self) -> int:
        return self._version

    @property
    def paused(self) -> bool:  # between a `pause` and the `resume` that ends it
        return self._paused

    def set_version(self, version: int) -> None:
        """Record the version the server now serves (called after a weight update it acknowledged)."""
        self._version = version

    async def generate(self, request: GenerateRequest) -> list[GenerateOutput]:
        self._require_open()
        self._served_adapter(request.request_id, request.adapter)  # a policy it serves no adapter for: refused now
        self._ensure_health_loop()
        if request.request_id in self._inflight:
            raise ValueError(f"request {request.request_id!r} is already in flight on {self.url}")
        if self._restarting is not None:  # requests wait for the server instead of failing meanwhile
            with contextlib.suppress(Exception):  # a failed restart shows as this request's connection failure
                await asyncio.shield(self._restarting)
        request = await self._fit_to_context(request)
        flight = _Flight()
        self._inflight[request.request_id] = flight
        try:
            outputs, epoch = await self._generate_once(request, flight)
            return list(await asyncio.gather(*(self._resume_kept(request, out, flight, epoch) for out in outputs)))
        finally:
            self._inflight.pop(request.request_id, None)

    async def abort(self, request_id: str | None = None) -> None:
        self._require_open()
        if request_id is None:
            for flight in self._inflight.values():
                flight.caller_aborted = True
            await self._call(protocol.ABORT, rid="", abort_all=True)
            return
        flight = self._inflight.get(request_id)
        if flight is not None:
            flight.caller_aborted = True
            await self._abort_rids(list(flight.rids))

    async def pause(self, mode: PauseMode = "keep") -> None:
        """Pause the server with SGLang's "abort" mode; "keep" is kept by resuming the aborted requests here."""
        check_pause_mode(mode)
        self._require_open()
        if mode == "keep":
            self._keep_epoch += 1
            self._keep_paused = True
        else:
            for flight in self._inflight.values():
                flight.caller_aborted = True
        self._paused = True
        await self._call(protocol.PAUSE, mode=protocol.WIRE_PAUSE_MODE)

    async def resume(self) -> None:
        self._require_open()
        await self._call(protocol.CONTINUE)
        self._paused = self._keep_paused = False

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        raise NotImplementedError(f"{self.url}: an SGLang server receives weights itself (driven by the loaders of "
                                  "engines/weights/transport.py), not as tensors handed to the client")

    async def health(self) -> dict[str, object]:
        healthy = not self._closed and await self._healthy(timeout=5.0)
        return {
            "engine": "sglang",
            "url": self.url,
            "healthy": healthy,
            "paused": self._paused,
            "version": self._version,
            "restarts": self.restarts,
            "requests": len(self._inflight),
            "failed_requests": self.failed_requests,
            "resumed_requests": self.resumed_requests,
            "memory_releases": self.memory_releases,  # a colocated run's hand-overs to the learner
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

    async def server_weight_version(self) -> int | None:
        """The server's weight version from `/model_info` (SGLang removed `/get_weight_version`)."""
        body = await self._call(protocol.MODEL_INFO)
        if not isinstance(body, dict):
            raise SglangError(f"{self.url}{protocol.MODEL_INFO.path}: expected a JSON object, got {str(body)[:200]!r}")
        return protocol.parse_weight_version(body.get("weight_version"))

    async def server_limits(self) -> ServerLimits | None:
        """The server's request-size limits from `/server_info`, fetched once; None if it does not answer."""
        async with self._limits_lock:
            if self._limits is None:
                try:
                    info = await self._call(protocol.SERVER_INFO)
                except SglangError as error:
                    logger.warning("%s: context length unknown (%s); requests are sent unclamped", self.url, error)
                    return None
                if not isinstance(info, dict):
                    return None
                self._limits = ServerLimits.from_server_info(info)
                if self._limits.context_length is None:
                    logger.warning("%s/server_info reports no context length; requests are sent unclamped", self.url)
            return self._limits

    # ---- generation

    async def _fit_to_context(self, request: GenerateRequest) -> GenerateRequest:
        """The torch engine's rule: a prompt that leaves no room is an error, max_new_tokens is clamped to the room."""
        limits = await self.server_limits()
        if limits is None:
            return request
        if request.params.seed is not None and limits.deterministic is False and not self._warned_seed:
            self._warned_seed = True
            logger.warning(
                "%s runs without --enable-deterministic-inference: SGLang ignores sampling_seed there, so seeded "
                "samples are not reproducible",
                self.url,
            )
        prompt = len(request.input_ids)
        if limits.input_limit is not None and prompt >= limits.input_limit:
            raise ContextFull(
                f"request {request.request_id!r}: prompt of {prompt} tokens leaves no room in the context of SGLang "
                f"server {self.url} (context {limits.context_length} tokens, prompts shorter than "
                f"{limits.input_limit} accepted)"
            )
        if limits.context_length is None or prompt + request.params.max_new_tokens <= limits.context_length:
            return request
        params = replace(request.params, max_new_tokens=limits.context_length - prompt)
        return replace(request, params=params)

    async def _generate_once(self, request: GenerateRequest, flight: _Flight,
                             routes_from: int = 0) -> tuple[list[GenerateOutput], int]:
        """One `/generate` call for `request`; returns its outputs and the "keep" pause count when it was sent.
        With `moe_routes`, each output's routes cover its tokens from `routes_from` on."""
        rids = protocol.wire_request_ids(request)
        started_version, epoch = self._version, self._keep_epoch
        adapter = self._served_adapter(request.request_id, request.adapter)
        # The adapter named is the version (the server's weight_version is the base's); a policy's request before its
        # first load runs on the base model, its version 0.
        tag = adapter[1] if adapter is not None else None if request.adapter is None else 0
        flight.rids.update(rids)
        self._take_adapter(adapter)
        try:
            body = await self._post_generate(request, adapter=None if adapter is None else adapter[0],
                                             routes_from=routes_from if self.moe_routes is not None else None)
        except asyncio.CancelledError:
            # Free the server's slots: the abort must outlive this cancelled task.
            asyncio.get_running_loop().create_task(self._abort_rids(rids))
            raise
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError, TimeoutError) as error:
            self.failed_requests += 1
            flight.lost = True
            logger.warning(
                "%s/generate failed (%r); request %s returns as aborted", self.url, error, request.request_id
            )
            return [_aborted(request, index) for index in range(request.params.n)], epoch
        finally:
            flight.rids.difference_update(rids)
            await self._release_adapter(adapter)
        items = body if isinstance(body, list) else [body]
        if len(items) != request.params.n:
            raise SglangError(f"{self.url}/generate returned {len(items)} outputs for n={request.params.n}")
        outputs = []
        for index, item in enumerate(items):
            parsed = protocol.parse_output_json(item, where=f"{self.url}/generate output {index}")
            whole = started_version if parsed.weight_version is None else min(started_version, parsed.weight_version)
            if tag is not None:
                versions = [tag] * len(parsed.output_ids)
            elif parsed.token_versions is None:
                versions = [whole] * len(parsed.output_ids)
            else:
                versions = [whole if version is None else version for version in parsed.token_versions]
            outputs.append(
                GenerateOutput(
                    request_id=request.request_id,
                    output_ids=parsed.output_ids,
                    log_probs=parsed.log_probs,
                    versions=versions,
                    finish_reason=parsed.finish_reason,
                    sample_index=index,
                    prompt_len=len(request.input_ids),
                    matched_stop=parsed.matched_stop,
                    routed_experts=self._routes(parsed, request, routes_from, where=f"output {index}"),
                )
            )
        return outputs, epoch

    def _routes(self, parsed: protocol.ParsedOutput, request: GenerateRequest, routes_from: int, *,
                where: str) -> RoutedExperts | None:
        """The output's routes as int16 [tokens from `routes_from` to the last but one, layers, k]; None when none
        were asked for, or for a sample aborted before generating anything."""
        if self.moe_routes is None:
            return None
        rows = len(request.input_ids) + len(parsed.output_ids) - 1 - routes_from
        if parsed.routed_experts is None:
            if parsed.finish_reason == "abort" and not parsed.output_ids:
                return None
            raise SglangError(f"{self.url}/generate {where} of {request.request_id!r} came without routed experts: "
                              f"start the server with --{protocol.ROUTED_EXPERTS_FLAG}")
        shape = self.moe_routes
        table = np.frombuffer(parsed.routed_experts, dtype="<i4")
        if table.size != rows * shape.layers * shape.top_k:
            raise SglangError(f"{self.url}/generate {where} of {request.request_id!r}: {table.size} routed experts, "
                              f"expected {rows} tokens x {shape.layers} layers x top-{shape.top_k}")
        moe = table.reshape(rows, shape.layers, shape.top_k)[:, list(shape.moe_layers)]  # dense layers route nowhere
        return RoutedExperts.of(moe)

    async def _resume_kept(
        self, request: GenerateRequest, output: GenerateOutput, flight: _Flight, epoch: int
    ) -> GenerateOutput:
        """Continue a sample that a "keep" pause aborted, until it finishes for its own reasons."""
        while output.finish_reason == "abort" and self._aborted_by_keep_pause(flight, epoch):
            if len(output.output_ids) >= request.params.max_new_tokens:
                return replace(output, finish_reason="length")
            resumed = continuation_request(request, output)
            # the routes the first part already has stay; the server sends those of the last input token on (of
            # every token when the first part has none: aborted before its prefill)
            routes_from = len(resumed.input_ids) - 1 if output.routed_experts is not None else 0
            more, epoch = await self._generate_once(resumed, flight, routes_from)
            self.resumed_requests += 1
            rest = more[0]
            output = replace(
                output,
                output_ids=output.output_ids + rest.output_ids,
                log_probs=output.log_probs + rest.log_probs,
                versions=output.versions + rest.versions,
                finish_reason=rest.finish_reason,
                matched_stop=rest.matched_stop,
                routed_experts=joined_routes(output.routed_experts, rest.routed_experts, routes_from),
            )
        return output

    def _aborted_by_keep_pause(self, flight: _Flight, epoch: int) -> bool:
        return not flight.caller_aborted and not flight.lost and (self._keep_paused or self._keep_epoch != epoch)

    # ---- HTTP

    async def _post_generate(self, request: GenerateRequest, *, adapter: str | None,
                             routes_from: int | None = None) -> Any:
        await self.take_back_memory()
        session = self._client()
        timeout = aiohttp.ClientTimeout(total=self.request_timeout)
        body = protocol.generate_json(request, adapter=adapter, routes_from=routes_from)
        async with session.post(self.url + protocol.GENERATE.path, json=body, timeout=timeout) as reply:
            if reply.status != 200:
                raise SglangError(
                    f"{self.url}{protocol.GENERATE.path}: HTTP {reply.status} for request {request.request_id!r}: "
                    f"{(await reply.text())[:500]}",
                    reply.status,
                )
            return await reply.json(content_type=None)

    async def _call(self, endpoint: Endpoint, *, timeout: float | None = None, **fields: Any) -> Any:
        """One control call through its protocol row: the row's method, a body of the row's fields only."""
        session = self._client()
        where = f"{self.url}{endpoint.path}"
        limit = aiohttp.ClientTimeout(total=timeout or self.control_timeout)
        body = protocol.request_body(endpoint, **fields) if endpoint.method == "POST" else None
        try:
            async with session.request(endpoint.method, self.url + endpoint.path, json=body, timeout=limit) as reply:
                text = await reply.text()
                if reply.status != 200:
                    raise SglangError(f"{where}: HTTP {reply.status}: {text[:500]}", reply.status)
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            raise SglangError(f"{where}: {type(error).__name__}: {error}") from error
        return _json_or_text(text, where)

    async def _abort_rids(self, rids: list[str]) -> None:
        for rid in rids:
            with contextlib.suppress(SglangError):
                await self._call(protocol.ABORT, rid=rid)

    async def _healthy(self, timeout: float) -> bool:
        """`/health` generates a token on SGLang, which waits out a pause and needs the memory a colocated server
        may have released: then `/model_info` answers (see `health_check_turn`)."""
        async with self.health_check_turn() as may_generate:
            endpoint = protocol.HEALTH if may_generate and not self._paused else protocol.MODEL_INFO
            try:
                async with self._client().get(self.url + endpoint.path,
                                              timeout=aiohttp.ClientTimeout(total=timeout)) as reply:
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
        self._served.clear()  # a fresh server has no adapters loaded; the base model is every policy's version 0
        # A fresh server is not paused, has no session open and may have been started differently.
        self._paused = self._keep_paused = False
        self._limits, self._sessions = None, None
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


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _json_or_text(text: str, where: str) -> Any:
    if not text:
        return None
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return text
    if isinstance(body, dict) and body.get("success") is False:
        raise SglangError(f"{where}: {body.get('message')}")
    return body


@dataclass(frozen=True)
class MoeRoutes:
    """The shape of a served model's routes: SGLang records `layers` (every decoder layer) x `top_k` experts per
    token; the learner replays the `moe_layers` among them (a dense layer's rows hold nothing)."""

    layers: int
    moe_layers: tuple[int, ...]
    top_k: int


def joined_routes(first: RoutedExperts | None, rest: RoutedExperts | None, rest_from: int) -> RoutedExperts | None:
    """A resumed sample's routes: the first part's for its tokens before `rest_from`, the continuation's after."""
    if rest is None:  # the continuation generated nothing (aborted again): the first part's routes are all
        return first
    if first is None:
        return rest if rest_from == 0 else None
    row_bytes = first.shape[1] * first.shape[2] * 2
    kept = first.data[: rest_from * row_bytes]
    return RoutedExperts(kept + rest.data, (rest_from + rest.shape[0], first.shape[1], first.shape[2]))
