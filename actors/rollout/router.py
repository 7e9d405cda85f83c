"""The router across all of a run's engines: a library in every rollout worker, not an actor of its own.

Each rollout worker owns one engine and serves it to the others (`engine_service.py`); its router sends each of
its generate calls to one of the run's engines, chosen by `policies.routing` from what the worker already knows:
the roster (the live rollout workers and their "engine" endpoints, hashed onto a ring) and the load (its own calls
in flight per engine, plus the load each engine reported in its last reply to it). A call goes straight from the
worker to the engine and back, with no router process to hop through, scale or lose, and every worker computes the
same owner for a key. docs/router.md says why it is not an actor.

Calls keyed alike (an agent episode's session; by default a group's id, so its samples share their prompt's keys
and values) go to one engine while it stays within the load bound (`--router-policy affinity`). A call whose engine
dies, leaves or stops before it answers is sent to the next engine within `--router-request-timeout`: the session
moves and that engine prefills it anew, and since the trajectory holds every token so far, nothing is lost; the
tokens carry the version of the engine that made them, whichever it was. Engines that join get their share of
keys and of keyless calls from the next roster on.

Per engine the worker counts calls, sequences, prompt tokens, prompt tokens whose keys and values the engine's
prefix cache held, generated tokens, and failovers away from it (`router.engine.<id>.*` in its heartbeat).
"""

from __future__ import annotations

import asyncio
import contextlib
import zlib
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq.asyncio

from actors.rollout.engine_calls import output_from_wire, request_to_wire
from actors.rollout.engine_service import ENGINE_ENDPOINT, EngineService
from bus import RpcClient, RpcClosed, RpcTimeout
from bus.schema import EngineAbort, EngineGenerated, Error, Member
from engines.inference.base import (
    ContextFull,
    GenerateOutput,
    GenerateRequest,
    InferenceEngine,
    KvCacheAccount,
    PauseMode,
    PrefixCacheStats,
)
from policies.routing import HashRing, choose_engine

if TYPE_CHECKING:
    import torch

ABORT_TIMEOUT_S = 1.0  # an abort is a courtesy: an engine that does not take it finishes the request for nothing
STOP_WAIT_S = 0.3  # at a stop, how long the aborts of our calls on other engines and the answers to theirs may take


class RouterTimeout(TimeoutError):
    """No engine answered a call within `--router-request-timeout`; names the request and the engines tried."""


@dataclass(frozen=True)
class Refusal:
    """Why an engine did not answer a call: it failed (died, left, stopped, never answered), or its weights are older
    than the caller may train on (`weights_behind`: no failure, the engine is fine for others)."""

    weights_behind: bool = False


FAILED, BEHIND = Refusal(), Refusal(weights_behind=True)


@dataclass
class EngineTally:
    """What one engine did for this worker's calls."""

    calls: int = 0
    sequences: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    tokens: int = 0
    failovers: int = 0  # calls that left it for another engine: it died, left, stopped or did not answer in time
    refused: int = 0  # calls it turned away because its weights were older than the buffer takes


class EngineRouter:
    """Routes the generate calls of one rollout worker over every engine of the run (see the module docstring)."""

    def __init__(self, local: InferenceEngine, *, local_id: str, policy: str, slack: float, timeout: float,
                 zmq_context: zmq.asyncio.Context | None = None, security: Any = None,
                 service: EngineService | None = None, log: Any = None,
                 min_version: Callable[[str | None], int] = lambda adapter: 0, engines_of: str | None = None) -> None:
        """`min_version(adapter)`: the oldest weights of the adapter's policy (None: a run of one) this worker may
        train on now (another engine with older weights, one restarted before the learner's next push, refuses the
        call and the call goes on). `engines_of`: whose engines it routes over, a policy's own (`own_engines`) or the
        run's shared ones (None): another model's engine never answers a call of ours."""
        if timeout <= 0:
            raise ValueError(f"router: the request timeout must be > 0 seconds, got {timeout}")
        self.local, self.local_id = local, local_id
        self.policy, self.slack, self.timeout = policy, slack, timeout
        self.min_version, self.engines_of = min_version, engines_of
        self._zmq, self._security, self._log = zmq_context, security, log
        self.service = service
        if service is not None:
            service.own_load = lambda: self._mine[self.local_id]
        self._clients: dict[str, RpcClient] = {}  # engine (its worker's actor id) -> a client of its endpoint
        self._ring = HashRing.of([local_id])
        self._mine: Counter[str] = Counter()  # sequences of this worker's calls in flight, per engine
        self._others: dict[str, int] = {}  # per remote engine: the others' load it reported last
        self._where: dict[str, str] = {}  # request id -> the engine running it now
        self._turn = zlib.crc32(local_id.encode())  # staggered: workers do not start round-robin on one engine
        self._aborts: set[asyncio.Task[Any]] = set()
        self._said_moved: set[str] = set()  # engines a failover was logged for, since they last (re)joined
        self.tallies: defaultdict[str, EngineTally] = defaultdict(EngineTally)
        self.counters: Counter[str] = Counter()

    # ------------------------------------------------------------------------------------------------ roster
    def sync(self, roster: Mapping[str, Member]) -> None:
        """Follow the roster: a live rollout worker with an engine endpoint is an engine; one that died, left or
        moved is dropped (a call waiting on it raises RpcClosed and goes on elsewhere), one that joined is added."""
        wanted = {member.actor_id: member.endpoints[ENGINE_ENDPOINT] for member in roster.values()
                  if member.role == "rollout" and member.alive and ENGINE_ENDPOINT in member.endpoints
                  and member.actor_id != self.local_id and member.policy == self.engines_of}
        if self.policy == "local":
            wanted = {}
        for engine, client in list(self._clients.items()):
            if wanted.get(engine) != client.endpoint:
                client.close()
                del self._clients[engine]
                self._others.pop(engine, None)
        for engine, endpoint in wanted.items():
            if engine not in self._clients:
                self._said_moved.discard(engine)
                if self._zmq is None:
                    raise RuntimeError("router: remote engines need a zmq context")
                self._clients[engine] = RpcClient(self._zmq, endpoint, client_id=self.local_id,
                                                  security=self._security)
        self._ring = HashRing.of([self.local_id, *self._clients])

    @property
    def engines(self) -> tuple[str, ...]:
        return self._ring.engines

    def running_on(self, request_id: str) -> str | None:
        """The engine one of this worker's calls is in the hands of now (None: none is)."""
        return self._where.get(request_id)

    def owner(self, key: str) -> str:
        """The engine `key` belongs to on the ring (where affinity sends it while that engine is within the bound)."""
        return self._ring.owner(key)

    def loads(self) -> dict[str, float]:
        """Outstanding sequences per engine as this worker knows them: its own calls, plus what the others have
        (exact for its own engine, the last reported figure for a remote one)."""
        loads = {engine: float(self._mine[engine] + self._others.get(engine, 0)) for engine in self._ring.engines}
        if self.service is not None:
            loads[self.local_id] = float(self._mine[self.local_id] + self.service.load())
        return loads

    # ------------------------------------------------------------------------------------------------ calls
    def engine_for(self, key: str | None) -> RoutedEngine:
        """An `InferenceEngine` whose calls route with `key` unless a request names its own `routing_key`."""
        return RoutedEngine(self, key)

    async def generate(self, request: GenerateRequest, key: str | None = None) -> list[GenerateOutput]:
        """`request`'s outputs from the engine the policy picks, or from the next one when that engine fails before
        answering; raises RouterTimeout when `--router-request-timeout` passes first."""
        key = request.routing_key or key
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        tried: list[str] = []
        while True:
            self._turn += 1
            engine = choose_engine(self.policy, key, self._ring, self.loads(), local=self.local_id, turn=self._turn,
                                   slack=self.slack, weight=request.params.n, excluded=tried)
            outputs = await self._call(engine, request, deadline)
            if not isinstance(outputs, Refusal):
                return outputs
            tried.append(engine)
            if outputs.weights_behind:
                self.tallies[engine].refused += 1
            else:
                self.tallies[engine].failovers += 1
                self.counters["router.failovers"] += 1
            if loop.time() >= deadline:
                raise RouterTimeout(f"request {request.request_id!r}: no engine answered within "
                                    f"--router-request-timeout {self.timeout:g} s (tried {', '.join(tried)})")
            if not outputs.weights_behind:
                self._say_moved(engine, request.request_id)

    async def abort(self, request_id: str | None = None, *, wait_s: float = ABORT_TIMEOUT_S) -> None:
        """Abort one of this worker's calls (or all of them) wherever it runs now: on our engine at once, on the
        others by message, waiting at most `wait_s` for them to take it (a stopping worker cannot wait longer)."""
        targets = list(self._where.items()) if request_id is None else [(request_id, self._where.get(request_id))]
        for rid, engine in targets:
            if engine == self.local_id:
                await self.local.abort(rid)
            elif engine is not None:
                self._spawn_abort(engine, rid)
        if self._aborts:
            await asyncio.wait(list(self._aborts), timeout=wait_s)

    async def _call(self, engine: str, request: GenerateRequest,
                    deadline: float) -> list[GenerateOutput] | Refusal:
        """The outputs from `engine`, or why another engine must make them."""
        weight = request.params.n
        self._mine[engine] += weight
        self._where[request.request_id] = engine
        try:
            if engine == self.local_id:
                outputs: list[GenerateOutput] | Refusal = await self.local.generate(request)
            else:
                outputs = await self._remote(engine, request, deadline)
        finally:
            self._mine[engine] -= weight
            self._where.pop(request.request_id, None)
        if not isinstance(outputs, Refusal):
            self._tally(engine, request, outputs)
        return outputs

    async def _remote(self, engine: str, request: GenerateRequest,
                      deadline: float) -> list[GenerateOutput] | Refusal:
        client = self._clients.get(engine)
        remaining = deadline - asyncio.get_running_loop().time()
        if client is None or remaining <= 0:
            return FAILED
        try:
            call = request_to_wire(request, min_version=self.min_version(request.adapter))
            reply = await client.call(call, timeout=remaining, retries=0)
        except (RpcClosed, RpcTimeout):  # it died, left or moved (the roster closed our client), or never answered
            return FAILED
        except asyncio.CancelledError:  # our caller gave the call up: so does the engine
            self._spawn_abort(engine, request.request_id)
            raise
        if isinstance(reply, Error):
            if reply.reason == "context_full":
                raise ContextFull(f"{engine}: {reply.detail}")
            if reply.reason == "bad_request":
                raise ValueError(f"{engine} refused request {request.request_id!r}: {reply.detail}")
            self.counters[f"router.engine_errors.{reply.reason}"] += 1
            # its weights are too old, it is stopping, or its engine failed: another engine takes the call
            return BEHIND if reply.reason == "weights_behind" else FAILED
        if not isinstance(reply, EngineGenerated):
            self.counters["router.engine_errors.unexpected_reply"] += 1
            return FAILED
        self._others[engine] = reply.load
        if reply.stopping and any(output.finish_reason == "abort" for output in reply.outputs):
            return FAILED  # cut short by its worker's stop: generated again elsewhere, from the same seed
        return [output_from_wire(request.request_id, output) for output in reply.outputs]

    def _say_moved(self, engine: str, request_id: str) -> None:
        """The first call that leaves an engine is said (naming it), the others are counted: an engine that dies
        with a hundred calls in flight is one line, not a hundred."""
        if self._log is None:
            return
        if engine in self._said_moved:
            self._log.debug("call moved to another engine", request=request_id, left=engine)
            return
        self._said_moved.add(engine)
        self._log.info("call moved to another engine", request=request_id, left=engine,
                       later=f"counted, not logged: router.engine.{engine}.failovers")

    def _tally(self, engine: str, request: GenerateRequest, outputs: list[GenerateOutput]) -> None:
        tally = self.tallies[engine]
        tally.calls += 1
        tally.sequences += len(outputs)
        tally.prompt_tokens += len(request.input_ids)
        tally.cached_tokens += max((output.cached_tokens for output in outputs), default=0)
        tally.tokens += sum(len(output.output_ids) for output in outputs)
        self.counters["router.calls"] += 1
        if engine != self.local_id:
            self.counters["router.remote_calls"] += 1

    def _spawn_abort(self, engine: str, request_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._abort_remote(engine, request_id))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _abort_remote(self, engine: str, request_id: str) -> None:
        client = self._clients.get(engine)
        if client is None:
            return
        with contextlib.suppress(RpcClosed, RpcTimeout):  # gone: the request went with it
            await client.call(EngineAbort(request_id=request_id), timeout=ABORT_TIMEOUT_S, retries=0)

    # ------------------------------------------------------------------------------------------------ metrics
    def metrics(self) -> dict[str, float]:
        """Heartbeat counters: totals, and per engine what it did for this worker's calls."""
        found = {key: float(value) for key, value in self.counters.items()}
        found["router.engines"] = float(len(self._ring.engines))
        prompt = sum(tally.prompt_tokens for tally in self.tallies.values())
        cached = sum(tally.cached_tokens for tally in self.tallies.values())
        found["router.cached_fraction"] = cached / prompt if prompt else 0.0
        loads = self.loads()
        for engine, tally in self.tallies.items():
            for name in tally.__dataclass_fields__:
                found[f"router.engine.{engine}.{name}"] = float(getattr(tally, name))
            found[f"router.engine.{engine}.load"] = loads.get(engine, 0.0)
        return found

    def close(self) -> None:
        for task in self._aborts:
            task.cancel()
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        self._ring = HashRing.of([self.local_id])


class RoutedEngine(InferenceEngine):
    """What a generate function sees as its engine: the run's engines behind one router. Generation routes (with
    the view's key unless a request names one); everything else is the worker's own engine, whose version,
    weights and lifetime the worker manages, so closing a view closes nothing. Attributes an engine has beyond the
    interface (an SGLang engine's `url`, which slime-style plugins call) are the local engine's."""

    def __init__(self, router: EngineRouter, key: str | None) -> None:
        self.router, self.key = router, key

    async def generate(self, request: GenerateRequest) -> list[GenerateOutput]:
        return await self.router.generate(request, self.key)

    async def abort(self, request_id: str | None = None) -> None:
        await self.router.abort(request_id)

    async def pause(self, mode: PauseMode = "keep") -> None:
        await self.router.local.pause(mode)

    async def resume(self) -> None:
        await self.router.local.resume()

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        await self.router.local.update_weights(named_tensors, version)

    @property
    def version(self) -> int:
        return self.router.local.version

    def cached_prefix_tokens(self, input_ids: list[int], adapter: str | None = None) -> int | None:
        return self.router.local.cached_prefix_tokens(input_ids, adapter)

    async def health(self) -> dict[str, object]:
        return await self.router.local.health()

    def kv_cache_account(self) -> KvCacheAccount | None:
        return self.router.local.kv_cache_account()

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        return self.router.local.prefix_cache_stats()

    async def close(self) -> None:
        """Nothing to close: the worker closes its engine."""

    def __getattr__(self, name: str) -> Any:
        if name == "router":  # looked up before __init__ set it (copy, pickle): not the local engine's
            raise AttributeError(name)
        return getattr(self.router.local, name)
