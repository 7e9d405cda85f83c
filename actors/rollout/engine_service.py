"""A rollout worker's engine, served to the other rollout workers of the run: their routers' generate calls arrive
on the worker's "engine" endpoint (its roster entry names it) and run on the engine in this process, beside the
worker's own calls, so every engine of the run is reachable from every worker whatever it is (a torch engine in
this process, an SGLang server this worker launched or attached to, a plugin).

Serving through the owning worker rather than letting callers reach an SGLang server's URL themselves keeps one
owner per engine: the tokens are tagged with the version the owner knows its engine serves, a weight push's
"keep" pause resumes the calls of every worker, and a LoRA run's requests name the adapter the owner loaded.

The endpoint has a socket of its own, not the worker's "rpc" one, so that generate calls, which take seconds, never
hold the slots a weight update order needs. Each reply carries the load the caller cannot see (the sequences in
flight for everyone else); at a stop the worker refuses new calls and marks the replies it still sends as
`stopping`, so their callers take them to another engine (`actors/rollout/router.py`).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import Any

import zmq.asyncio

from actors.rollout.engine_calls import output_to_wire, request_from_wire
from actors.runtime import chaos
from bus import RpcServer
from bus.schema import Ack, EngineAbort, EngineGenerate, EngineGenerated, Error, Message
from engines.inference.base import ContextFull, InferenceEngine

ENGINE_ENDPOINT = "engine"  # the roster's name for a rollout worker's served engine
MAX_SERVED_CALLS = 4096  # calls handled at once; more wait in the socket (the engine queues what its rows cannot take)


class EngineService:
    """Serves `engine` on its own request/reply socket bound at `bind`."""

    def __init__(self, engine: InferenceEngine, *, zmq_context: zmq.asyncio.Context, bind: str,
                 security: Any = None) -> None:
        self.engine = engine
        self.server = RpcServer(zmq_context, bind, security=security, max_concurrency=MAX_SERVED_CALLS)
        self.counters: Counter[str] = Counter()
        self._load: Counter[str] = Counter()  # caller -> sequences of its calls in flight here
        self._idle = asyncio.Event()
        self._idle.set()
        self.stopping = False
        self.own_load: Callable[[], int] = lambda: 0  # the worker's own calls on its engine (its router counts them)

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def load(self, excluding: str | None = None) -> int:
        """Sequences in flight for other workers' calls (all callers', less `excluding`'s)."""
        return sum(count for caller, count in self._load.items() if caller != excluding)

    def engine_load(self, excluding: str) -> int:
        """Sequences in flight on the engine for everyone but `excluding`, this worker's own calls included."""
        return self.load(excluding) + self.own_load()

    async def serve(self) -> None:
        await self.server.serve(self._handle)

    def stop_serving(self) -> None:
        """From now on refuse new calls and mark the replies still to come `stopping`: their callers move them."""
        self.stopping = True

    async def drain(self, timeout: float) -> None:
        """Until every call in hand was answered (the engine's abort ends them), or `timeout`."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            self.counters["engine.served_unanswered_at_stop"] += len(self._load)

    def close(self) -> None:
        self.server.close()

    def metrics(self) -> dict[str, float]:
        """Its counters, and what its socket dropped, by reason and by sender, as every bound socket reports it."""
        found = {key: float(value) for key, value in self.counters.items()}
        found["engine.served_in_flight"] = float(self.load())
        found.update(self.server.drop_metrics(ENGINE_ENDPOINT))
        return found

    async def _handle(self, caller: str, message: Message) -> Message:
        if isinstance(message, EngineGenerate):
            return await self._generate(caller, message)
        if isinstance(message, EngineAbort):
            await self.engine.abort(message.request_id)
            return Ack(ok=True)
        self.counters[f"engine.served_refused.{type(message).__name__}"] += 1
        return Error(reason="unhandled", detail=f"the engine endpoint serves EngineGenerate and EngineAbort, not "
                                                f"{type(message).__name__}")

    async def _generate(self, caller: str, call: EngineGenerate) -> Message:
        if self.stopping:
            self.counters["engine.served_refused.stopping"] += 1
            return Error(reason="engine_stopping", detail="the worker is stopping; send the call to another engine")
        served = served_version(self.engine, call.adapter)
        if served < call.min_version:  # a worker that restarted, before the learner's next push
            self.counters["engine.served_refused.weights_behind"] += 1
            whose = "" if call.adapter is None else f" of adapter {call.adapter!r}"
            return Error(reason="weights_behind", detail=f"this engine serves version {served}{whose}; the call "
                                                         f"takes version {call.min_version} or newer")
        try:
            request = request_from_wire(call)
        except ValueError as error:
            return Error(reason="bad_request", detail=str(error))
        weight = request.params.n
        self._load[caller] += weight
        self._idle.clear()
        try:
            outputs = await chaos.during("engine_serve.mid", self.engine.generate(request))
        except ContextFull as error:
            return Error(reason="context_full", detail=str(error))
        except ValueError as error:  # the engine refused the request (a token outside its vocabulary): by name
            return Error(reason="bad_request", detail=str(error))
        finally:
            self._load[caller] -= weight
            if self._load[caller] <= 0:
                del self._load[caller]
            if not self._load:
                self._idle.set()
        self.counters["engine.served_calls"] += 1
        self.counters["engine.served_tokens"] += sum(len(output.output_ids) for output in outputs)
        return EngineGenerated(request_id=call.request_id, outputs=[output_to_wire(output) for output in outputs],
                               engine_version=self.engine.version, load=self.engine_load(caller),
                               stopping=self.stopping)


def served_version(engine: InferenceEngine, adapter: str | None) -> int:
    """The version a call naming `adapter` would be generated with: the adapter's (a policy's, in a run of several),
    or the engine's own weights'. An engine that serves no named adapters refuses such a call when it generates."""
    adapter_version = getattr(engine, "adapter_version", None)
    return engine.version if adapter is None or adapter_version is None else adapter_version(adapter)
