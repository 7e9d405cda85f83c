"""A rollout worker's router over real engines: its own torch engine in the test's process and others in processes of
their own, each served over the bus as a worker serves it (tools/standins/engine_server.py). A session stays on one
engine and reuses its prefix there; a call whose engine is killed, leaves or stops goes to another engine within
its deadline, with the tokens tagged by the engine that made them; an engine that joins gets calls."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
import zmq.asyncio

from actors.rollout.engine_service import EngineService
from actors.rollout.router import EngineRouter, RouterTimeout
from bus.address import bind_address
from bus.schema import Member
from engines.inference import GenerateRequest, SamplingParams, TorchEngine
from tools.standins import engine_server
from tools.standins.engine_server import EngineServer

pytestmark = pytest.mark.integration

LOCAL = "rollout-0-0"


def member(actor_id: str, endpoint: str, *, alive: bool = True) -> Member:
    return Member(actor_id=actor_id, role="rollout", node="test", pid=0, endpoints={"engine": endpoint}, alive=alive)


def roster(servers: dict[str, EngineServer], *, dead: tuple[str, ...] = ()) -> dict[str, Member]:
    return {name: member(name, server.endpoint, alive=name not in dead) for name, server in servers.items()}


def request(rid: str, prompt: list[int], tokens: int = 8, *, key: str | None = None) -> GenerateRequest:
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True, seed=7)
    return GenerateRequest(rid, prompt, params, routing_key=key)


def key_owned_by(router: EngineRouter, engine: str) -> str:
    return next(key for key in (f"session-{index}" for index in range(10_000)) if router.owner(key) == engine)


@pytest.fixture(scope="module")
def servers(tiny_model_path: Path) -> Iterator[dict[str, EngineServer]]:
    """Two engines in processes of their own, serving weights of versions 1 and 2."""
    started = engine_server.start_all(tiny_model_path, 2, version=1)
    named = dict(zip(["rollout-0-1", "rollout-0-2"], started, strict=True))
    yield named
    for server in started:
        server.stop()


@pytest_asyncio.fixture
async def local(tiny_model_path: Path) -> AsyncIterator[TorchEngine]:
    engine = TorchEngine.from_pretrained(tiny_model_path, version=3)
    yield engine
    await engine.close()


@pytest_asyncio.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    made = zmq.asyncio.Context()
    yield made
    made.destroy(linger=0)


def make_router(local: TorchEngine, context: zmq.asyncio.Context, policy: str = "affinity",
                timeout: float = 60.0) -> EngineRouter:
    return EngineRouter(local, local_id=LOCAL, policy=policy, slack=1.0, timeout=timeout, zmq_context=context)


async def test_a_session_stays_on_its_engine_and_each_turn_reuses_the_turns_before_it(
        servers: dict[str, EngineServer], local: TorchEngine, context: zmq.asyncio.Context) -> None:
    router = make_router(local, context)
    router.sync(roster(servers))
    key = key_owned_by(router, "rollout-0-1")
    history = [5, 6, 7, 8, 9, 10, 11, 12]
    cached = []
    for turn in range(3):
        [output] = await router.generate(request(f"s-{turn}", history, key=key))
        cached.append(output.cached_tokens)
        assert output.versions == [1] * 8  # made by rollout-0-1, which serves version 1
        history = history + output.output_ids + [13, 14]
    router.close()
    assert set(router.tallies) == {"rollout-0-1"} and router.tallies["rollout-0-1"].calls == 3
    assert cached[0] == 0 and all(tokens >= 8 for tokens in cached[1:])  # each turn found the history before it


async def test_round_robin_spreads_one_session_over_every_engine(servers: dict[str, EngineServer],
                                                                  local: TorchEngine,
                                                                  context: zmq.asyncio.Context) -> None:
    router = make_router(local, context, policy="round-robin")
    router.sync(roster(servers))
    for turn in range(3):
        await router.generate(request(f"rr-{turn}", [3, 4, 5], key="one-session"))
    router.close()
    assert {engine: tally.calls for engine, tally in router.tallies.items()} == {
        LOCAL: 1, "rollout-0-1": 1, "rollout-0-2": 1}


async def test_a_call_whose_engine_is_killed_goes_on_to_the_next_engine_within_its_deadline(
        tiny_model_path: Path, servers: dict[str, EngineServer], local: TorchEngine,
        context: zmq.asyncio.Context) -> None:
    """The engine is frozen before the call reaches it, so it is in hand there when kill -9 ends it; the roster
    then says it died, as the controller's would after its heartbeat deadline, and the call moves on."""
    [doomed] = engine_server.start_all(tiny_model_path, 1, version=1)
    try:
        engines = {**servers, "rollout-0-3": doomed}
        router = make_router(local, context, timeout=60.0)
        router.sync(roster(engines))
        key = key_owned_by(router, "rollout-0-3")
        os.kill(doomed.pid, signal.SIGSTOP)
        started = time.monotonic()
        call = asyncio.create_task(router.generate(request("doomed-1", [5, 6, 7, 8], tokens=16, key=key)))
        while router.running_on("doomed-1") != "rollout-0-3":  # sent: in the frozen engine's hands
            await asyncio.sleep(0.01)
        doomed.kill()
        router.sync(roster(engines, dead=("rollout-0-3",)))
        [output] = await asyncio.wait_for(call, 60.0)
        router.close()
    finally:
        doomed.stop()
    assert time.monotonic() - started < 60.0
    assert len(output.output_ids) == 16 and output.finish_reason == "length"
    assert router.tallies["rollout-0-3"].failovers == 1 and router.counters["router.failovers"] == 1
    moved_to = [engine for engine, tally in router.tallies.items() if tally.calls]
    assert len(moved_to) == 1 and moved_to[0] != "rollout-0-3"
    assert set(output.versions) == {3 if moved_to[0] == LOCAL else 1}  # the version of the engine that made them


async def test_a_call_on_a_worker_that_stops_goes_on_to_another_engine(local: TorchEngine,
                                                                      context: zmq.asyncio.Context,
                                                                      tiny_model_path: Path) -> None:
    """The owner stops as a worker does: it refuses new calls, aborts its engine and answers the calls in hand as
    `stopping`; their callers send them to another engine."""
    owner_engine = TorchEngine.from_pretrained(tiny_model_path, version=1)
    service = EngineService(owner_engine, zmq_context=context, bind=bind_address())
    serving = asyncio.ensure_future(service.serve())
    try:
        router = make_router(local, context)
        router.sync({"rollout-0-1": member("rollout-0-1", service.endpoint)})
        key = key_owned_by(router, "rollout-0-1")
        await owner_engine.pause("keep")  # nothing it takes finishes until the stop
        call = asyncio.create_task(router.generate(request("stopped-1", [4, 5, 6], key=key)))
        while not service.load():
            await asyncio.sleep(0.01)
        service.stop_serving()
        await owner_engine.abort(None)
        [output] = await asyncio.wait_for(call, 30.0)
        refused = await router.generate(request("stopped-2", [4, 5, 6], key=key))  # a new call: refused, moved
        router.close()
    finally:
        service.close()
        serving.cancel()
        await owner_engine.close()
    assert output.finish_reason == "length" and output.versions == [3] * 8  # generated again, by the local engine
    assert len(refused[0].output_ids) == 8
    assert router.tallies["rollout-0-1"].failovers == 2 and router.tallies[LOCAL].calls == 2
    assert router.counters["router.engine_errors.engine_stopping"] == 1


async def test_a_frozen_engine_ends_the_call_at_its_deadline_naming_the_engine(
        tiny_model_path: Path, local: TorchEngine, context: zmq.asyncio.Context) -> None:
    [frozen] = engine_server.start_all(tiny_model_path, 1)
    try:
        router = make_router(local, context, timeout=2.0)
        router.sync({"rollout-0-9": member("rollout-0-9", frozen.endpoint)})
        os.kill(frozen.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(RouterTimeout, match=r"within --router-request-timeout 2 s \(tried rollout-0-9\)"):
            await router.generate(request("frozen-1", [4, 5], key=key_owned_by(router, "rollout-0-9")))
        assert 2.0 <= time.monotonic() - started < 10.0
        router.close()
    finally:
        frozen.kill()


async def test_an_engine_that_joins_gets_its_share_of_calls(servers: dict[str, EngineServer], local: TorchEngine,
                                                            context: zmq.asyncio.Context) -> None:
    router = make_router(local, context)
    router.sync({})
    key = "joined-session"
    await router.generate(request("before-join", [3, 4], key=key))
    router.sync(roster(servers))
    keys = [key_owned_by(router, engine) for engine in router.engines]
    for index, each in enumerate(keys):
        await router.generate(request(f"after-join-{index}", [3, 4], key=each))
    await router.generate(request("keyless", [3, 4]))  # the least loaded: all idle, so the local one
    assert router.engines == (LOCAL, "rollout-0-1", "rollout-0-2")
    router.close()
    assert {engine for engine, tally in router.tallies.items() if tally.calls} == {LOCAL, "rollout-0-1", "rollout-0-2"}
    assert router.tallies["rollout-0-1"].calls == 1 and router.tallies["rollout-0-2"].calls == 1
    assert router.tallies[LOCAL].calls == 3


async def test_a_session_that_moves_between_engines_at_different_versions_never_reuses_older_keys_and_values(
        local: TorchEngine, context: zmq.asyncio.Context, tiny_model_path: Path) -> None:
    """Turn 1 on its owner (version 1), turn 2 on the local engine (version 3) while the owner stops serving, turn 3
    back on the owner after a weight update (version 4): every token carries the version of the engine that made
    it, the owner prefills the history its cache holds from version 1 again instead of reusing it, and neither
    engine's account shows a token sampled over older keys and values (what the certificate checks)."""
    owner = TorchEngine.from_pretrained(tiny_model_path, version=1)
    service = EngineService(owner, zmq_context=context, bind=bind_address())
    serving = asyncio.ensure_future(service.serve())
    try:
        router = make_router(local, context)
        router.sync({"rollout-0-1": member("rollout-0-1", service.endpoint)})
        key = key_owned_by(router, "rollout-0-1")
        history = [5, 6, 7, 8, 9, 10]
        [first] = await router.generate(request("moving-1", history, key=key))
        history += [*first.output_ids, 11, 12]
        service.stop_serving()
        [second] = await router.generate(request("moving-2", history, key=key))
        history += [*second.output_ids, 13, 14]
        await owner.update_weights(owner.weights_snapshot()[:1], 4)  # same values, a new version: old KV is void
        service.stopping = False
        [third] = await router.generate(request("moving-3", history, key=key))
        router.close()
    finally:
        service.close()
        serving.cancel()
        await owner.close()
    assert (first.versions, second.versions, third.versions) == ([1] * 8, [3] * 8, [4] * 8)
    assert second.cached_tokens == 0  # the local engine never saw the session
    # it held turn 1 (6 prompt tokens and the answer's 8 but the last, never fed to the model), from version 1
    assert third.cached_tokens == 0 and third.stale_cached_tokens == 6 + 8 - 1
    assert owner.kv_cache_account().stale_kv_tokens == 0 and local.kv_cache_account().stale_kv_tokens == 0


async def test_an_engine_whose_weights_the_buffer_would_not_take_turns_calls_away_without_generating(
        local: TorchEngine, context: zmq.asyncio.Context, tiny_model_path: Path) -> None:
    """A worker restarted before the learner's next push serves its first weights: a caller that may train only on
    version 2 or newer is refused at once and its call goes to an engine whose weights it may use."""
    behind = TorchEngine.from_pretrained(tiny_model_path, version=1)
    service = EngineService(behind, zmq_context=context, bind=bind_address())
    serving = asyncio.ensure_future(service.serve())
    try:
        router = EngineRouter(local, local_id=LOCAL, policy="affinity", slack=1.0, timeout=60.0, zmq_context=context,
                              min_version=lambda adapter: 2)
        router.sync({"rollout-0-1": member("rollout-0-1", service.endpoint)})
        [output] = await router.generate(request("behind-1", [4, 5, 6], key=key_owned_by(router, "rollout-0-1")))
        router.close()
    finally:
        service.close()
        serving.cancel()
        await behind.close()
    assert output.versions == [3] * 8  # the local engine's
    assert (router.tallies["rollout-0-1"].refused, router.tallies["rollout-0-1"].failovers) == (1, 0)
    assert service.counters["engine.served_refused.weights_behind"] == 1
    assert "engine.served_calls" not in service.counters  # nothing was generated there
    assert router.counters["router.failovers"] == 0


async def test_a_call_is_turned_away_by_an_engine_only_where_its_own_policys_adapter_is_behind(
        context: zmq.asyncio.Context, tiny_model_path: Path) -> None:
    """A run of two policies: the other engine has a's version 2 but b's fresh adapter (0); a caller that may train
    on version 2 or newer of either is served there for a, and turned away there for b."""
    from tests.support.adapters import random_adapter

    remote = TorchEngine.from_pretrained(tiny_model_path, lora_scaling=2.0, adapters=("a", "b"))
    own = TorchEngine.from_pretrained(tiny_model_path, lora_scaling=2.0, adapters=("a", "b"))
    service = EngineService(remote, zmq_context=context, bind=bind_address())
    serving = asyncio.ensure_future(service.serve())
    try:
        await remote.update_weights(random_adapter(remote.model, 4, 1, scale=0.5), 2, adapter="a")
        await own.update_weights(random_adapter(own.model, 4, 2, scale=0.5), 2, adapter="b")
        router = EngineRouter(own, local_id=LOCAL, policy="affinity", slack=1.0, timeout=60.0, zmq_context=context,
                              min_version=lambda adapter: 2)
        router.sync({"rollout-0-1": member("rollout-0-1", service.endpoint)})
        key = key_owned_by(router, "rollout-0-1")
        outputs = {}
        for adapter in ("a", "b"):
            call = GenerateRequest(f"call-{adapter}", [4, 5, 6], request("x", [1]).params, routing_key=key,
                                   adapter=adapter)
            [outputs[adapter]] = await router.generate(call)
        router.close()
    finally:
        service.close()
        serving.cancel()
        await remote.close()
        await own.close()
    assert (outputs["a"].versions, outputs["b"].versions) == ([2] * 8, [2] * 8)  # a's there, b's here
    assert service.counters["engine.served_calls"] == 1
    assert service.counters["engine.served_refused.weights_behind"] == 1
    assert router.tallies["rollout-0-1"].refused == 1


async def test_a_router_routes_over_its_own_models_engines_only(local: TorchEngine,
                                                                context: zmq.asyncio.Context) -> None:
    """A policy with engines of its own (own_engines) has another model on them: the run's shared engines and its
    own never take each other's calls, although they are all rollout workers of one run."""
    engines = {"rollout-0-1": None, "rollout-0-0@solver": "solver", "rollout-0-1@solver": "solver",
               "rollout-0-0@judge": "judge"}
    found = {name: Member(actor_id=name, role="rollout", node="test", pid=0, policy=policy,
                          endpoints={"engine": f"tcp://127.0.0.1:{50000 + index}"})
             for index, (name, policy) in enumerate(engines.items())}
    shared = make_router(local, context)
    own = EngineRouter(local, local_id="rollout-0-0@solver", policy="affinity", slack=1.0, timeout=60.0,
                       zmq_context=context, engines_of="solver")
    for router in (shared, own):
        router.sync(found)
    assert shared.engines == (LOCAL, "rollout-0-1")
    assert own.engines == ("rollout-0-0@solver", "rollout-0-1@solver")
    shared.close()
    own.close()
