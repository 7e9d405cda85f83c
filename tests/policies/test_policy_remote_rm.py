"""The remote reward model client against real aiohttp servers on 127.0.0.1."""

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from policies.rewards import RewardInput, score
from policies.rewards.remote import RemoteRewardError, RemoteRewardModel

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
StartServer = Callable[[Handler], Awaitable[str]]


async def _serve(handler: Handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/score", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # aiohttp exposes no public accessor
    return runner, f"http://127.0.0.1:{port}/score"


@pytest.fixture
async def server() -> AsyncIterator[StartServer]:
    runners: list[web.AppRunner] = []

    async def start(handler: Handler) -> str:
        runner, url = await _serve(handler)
        runners.append(runner)
        return url

    yield start
    for runner in runners:
        await runner.cleanup()


INPUT = RewardInput(prompt="2+2?", response="4", label="4", metadata={"task": "arith"})


@pytest.mark.integration
async def test_remote_reward_posts_the_sample_and_reads_the_reward(server: StartServer) -> None:
    seen = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.json_response({"reward": 0.75, "judge": "v2"})

    model = RemoteRewardModel(await server(handler))
    (outcome,) = await score(model, [INPUT])
    await model.aclose()
    assert seen == [{"prompt": "2+2?", "response": "4", "label": "4", "metadata": {"task": "arith"}}]
    assert outcome.reward == 0.75 and outcome.extras == {"judge": "v2"}


@pytest.mark.integration
async def test_server_failing_twice_then_succeeding_is_retried_with_backoff(server: StartServer) -> None:
    attempts: list[float] = []

    async def flaky(request: web.Request) -> web.Response:
        attempts.append(time.perf_counter())
        if len(attempts) <= 2:
            return web.Response(status=503, text="warming up")
        return web.json_response(1.0)

    model = RemoteRewardModel(await server(flaky), max_retries=3, backoff_s=0.05)
    (outcome,) = await score(model, [INPUT])
    await model.aclose()
    assert outcome.reward == 1.0 and len(attempts) == 3
    gaps = [b - a for a, b in itertools.pairwise(attempts)]
    assert gaps[0] >= 0.04 and gaps[1] >= 0.08  # exponential backoff (0.05 s, then 0.1 s, +-10%)


@pytest.mark.integration
async def test_hanging_server_becomes_a_timeout_error_outcome(server: StartServer) -> None:
    release = asyncio.Event()

    async def hangs(request: web.Request) -> web.Response:
        await release.wait()
        return web.json_response(1.0)

    model = RemoteRewardModel(await server(hangs), timeout_s=0.2, max_retries=1, backoff_s=0.01)
    start = time.perf_counter()
    (outcome,) = await score(model, [INPUT])
    release.set()
    await model.aclose()
    assert outcome.status == "error"
    assert "2 attempt(s) failed; last: timed out after 0.2s" in outcome.reason
    assert time.perf_counter() - start < 2.0


@pytest.mark.integration
async def test_client_errors_are_not_retried(server: StartServer) -> None:
    calls = 0

    async def rejects(request: web.Request) -> web.Response:
        nonlocal calls
        calls += 1
        return web.Response(status=422, text="label missing")

    model = RemoteRewardModel(await server(rejects), max_retries=3, backoff_s=0.01)
    with pytest.raises(RemoteRewardError, match="HTTP 422 \\(not retried\\): label missing"):
        await model(INPUT)
    await model.aclose()
    assert calls == 1


@pytest.mark.integration
async def test_unreachable_server_is_an_error_outcome_not_a_crash() -> None:
    async def never_called(request: web.Request) -> web.Response:
        return web.json_response(1.0)

    runner, url = await _serve(never_called)
    await runner.cleanup()  # nothing listens on that port any more
    model = RemoteRewardModel(url, max_retries=1, backoff_s=0.01)
    (outcome,) = await score(model, [INPUT])
    await model.aclose()
    assert outcome.status == "error" and "ClientConnectorError" in outcome.reason
