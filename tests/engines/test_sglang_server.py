"""The SGLang client against the SGLang-compatible server, for real: a server process and HTTP on loopback.

The main check is parity: greedy and seeded decoding through client + server equal the torch engine used
directly (token for token, log-probs within 1e-5).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

from actors.rollout.engine_factory import attached_server_version
from engines.inference.base import GenerateRequest, SamplingParams, continuation_request
from engines.inference.torch_engine import TorchEngine
from engines.sglang.client import SglangEngine, SglangError
from engines.sglang.launch import ServerProcess, ServerSpec, probe
from tests.support.waiting import until

PROMPT = [3, 14, 15, 9, 26, 5]


@pytest.fixture(scope="module")
def server(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The module's one server; its generate-based health check gives up after 1 s (SGLang's default is 20 s), for
    the paused-server test: only /health and /health_generate read that setting."""
    spec = ServerSpec(
        model_path=str(tiny_model_path),
        module="tools.standins.sglang_server",
        random_seed=3,
        extra={"torch-threads": "1", "mem-fraction-static": "0.8", "enable-metrics": "true"},
    )
    env = {**os.environ, "SGLANG_HEALTH_CHECK_TIMEOUT": "1"}
    process = ServerProcess(spec, startup_timeout=120, log_dir=tmp_path_factory.mktemp("sglang-logs"), env=env)
    process.start()
    yield process
    process.stop()


@pytest.fixture
async def client(server: ServerProcess) -> AsyncIterator[SglangEngine]:
    engine = SglangEngine(server.url)
    yield engine
    await engine.close()


@pytest.mark.integration
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_new_tokens=12),
        SamplingParams(temperature=0, max_new_tokens=8, n=3),
        SamplingParams(temperature=1.0, seed=11, max_new_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=5, max_new_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(56,)),
    ],
    ids=["greedy", "greedy-n3", "seeded", "seeded-top-p-top-k", "stop-token"],
)
async def test_greedy_and_seeded_decoding_equal_the_torch_engine(
    client: SglangEngine, tiny_model_path: Path, params: SamplingParams
) -> None:
    request = GenerateRequest("parity", PROMPT, params)
    reference = TorchEngine.from_pretrained(tiny_model_path)
    try:
        expected = await reference.generate(request)
    finally:
        await reference.close()
    got = await client.generate(request)
    assert [o.output_ids for o in got] == [o.output_ids for o in expected]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in expected]
    assert [o.matched_stop for o in got] == [o.matched_stop for o in expected]
    for mine, theirs in zip(got, expected, strict=True):
        assert mine.log_probs == pytest.approx(theirs.log_probs, abs=1e-5)
        assert mine.versions == [0] * len(mine.output_ids)
        assert mine.prompt_len == len(PROMPT)


@pytest.mark.integration
async def test_seeded_samples_of_one_request_differ_and_repeat(client: SglangEngine) -> None:
    params = SamplingParams(temperature=1.0, seed=42, n=3, max_new_tokens=10, ignore_eos=True)
    first = await client.generate(GenerateRequest("a", PROMPT, params))
    second = await client.generate(GenerateRequest("b", PROMPT, params))
    assert [o.output_ids for o in first] == [o.output_ids for o in second]
    assert len({tuple(o.output_ids) for o in first}) > 1
    assert [o.sample_index for o in first] == [0, 1, 2]


@pytest.mark.integration
async def test_pause_keep_holds_requests_until_continue(client: SglangEngine) -> None:
    await client.pause("keep")
    try:
        task = asyncio.create_task(client.generate(GenerateRequest("held", PROMPT, SamplingParams(max_new_tokens=4))))
        await asyncio.sleep(0.5)
        assert not task.done()
    finally:
        await client.resume()
    outputs = await asyncio.wait_for(task, 30)
    assert outputs[0].finish_reason in ("stop", "length") and outputs[0].output_ids


async def server_metrics(server: ServerProcess) -> dict[str, float]:
    """The server's Prometheus gauges by name (labels dropped)."""
    async with aiohttp.ClientSession() as session, session.get(f"{server.url}/metrics") as response:
        text = await response.text()
    return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


async def decoding_started(server: ServerProcess, tokens_before: float) -> None:
    """Until the server is decoding a request that has produced a token since `tokens_before`."""
    async def decoding() -> bool:
        seen = await server_metrics(server)
        return seen["sglang:num_running_reqs"] >= 1 and seen["sglang:generation_tokens_total"] > tokens_before

    await until(decoding, "a request being decoded")


async def server_idle(server: ServerProcess) -> None:
    """Until the server decodes no request."""
    async def idle() -> bool:
        return (await server_metrics(server))["sglang:num_running_reqs"] == 0

    await until(idle, "the server to decode no request")


@pytest.mark.integration
async def test_pause_abort_returns_partial_output_that_resumes_to_the_same_greedy_text(
    client: SglangEngine, server: ServerProcess
) -> None:
    # The whole context (512 tokens), so the request is still decoding when the pause that follows its first
    # token arrives, however busy the machine (that pause used to be sent after a fixed 0.3 s).
    params = SamplingParams(temperature=0, max_new_tokens=512 - len(PROMPT), ignore_eos=True)
    request = GenerateRequest("long", PROMPT, params)
    whole = (await client.generate(GenerateRequest("whole", PROMPT, params)))[0]
    tokens_before = (await server_metrics(server))["sglang:generation_tokens_total"]
    task = asyncio.create_task(client.generate(request))
    await decoding_started(server, tokens_before)
    await client.pause("abort")
    await client.resume()
    partial = (await asyncio.wait_for(task, 60))[0]
    assert partial.finish_reason == "abort"
    assert 0 < len(partial.output_ids) < params.max_new_tokens
    rest = (await client.generate(continuation_request(request, partial)))[0]
    assert partial.output_ids + rest.output_ids == whole.output_ids


@pytest.mark.integration
async def test_cancelled_generate_aborts_the_request_on_the_server(client: SglangEngine,
                                                                   server: ServerProcess) -> None:
    params = SamplingParams(temperature=0, max_new_tokens=512 - len(PROMPT), ignore_eos=True)
    tokens_before = (await server_metrics(server))["sglang:generation_tokens_total"]
    task = asyncio.create_task(client.generate(GenerateRequest("cancelled", PROMPT, params)))
    await decoding_started(server, tokens_before)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await server_idle(server)  # the client's abort reached the server and ended the request there
    # The server's slot is free again: the same rid is accepted at once (a live one would be refused).
    short = SamplingParams(temperature=0, max_new_tokens=2)
    outputs = await asyncio.wait_for(client.generate(GenerateRequest("cancelled", PROMPT, short)), 20)
    assert len(outputs[0].output_ids) == 2


@pytest.mark.integration
async def test_bad_request_error_names_the_server_and_endpoint(client: SglangEngine) -> None:
    with pytest.raises(SglangError, match=r"http://127\.0\.0\.1:\d+/generate: HTTP 400.*vocabulary"):
        await client.generate(GenerateRequest("bad", [10_000_000], SamplingParams(max_new_tokens=2)))


@pytest.mark.integration
def test_unknown_sglang_arguments_are_ignored_with_a_warning(server: ServerProcess) -> None:
    assert "ignoring SGLang arguments" in server.log_tail(200)
    assert "--mem-fraction-static 0.8 --enable-metrics" in server.log_tail(200)


@pytest.mark.integration
async def test_abort_of_one_request_leaves_a_request_whose_id_extends_it_running(client: SglangEngine) -> None:
    """SGLang aborts by rid PREFIX: aborting `x/1` must not end `x/10` (our wire rids are prefix-free)."""
    params = SamplingParams(temperature=0, max_new_tokens=200, ignore_eos=True)
    await client.pause("keep")  # both wait in the server, so both are certainly in flight at the abort
    try:
        short = asyncio.create_task(client.generate(GenerateRequest("x/1", PROMPT, params)))
        long = asyncio.create_task(client.generate(GenerateRequest("x/10", PROMPT, params)))
        await asyncio.sleep(0.3)
        await client.abort("x/1")
    finally:
        await client.resume()
    aborted, finished = await asyncio.wait_for(asyncio.gather(short, long), 60)
    assert aborted[0].finish_reason == "abort"
    assert finished[0].finish_reason == "length" and len(finished[0].output_ids) == 200


@pytest.mark.integration
async def test_prompt_near_the_context_length_is_clamped_and_one_without_room_is_an_error(
    client: SglangEngine, tiny_model_path: Path
) -> None:
    """As the torch engine: max_new_tokens shrinks to the room left; SGLang would answer HTTP 400 instead."""
    limits = await client.server_limits()
    assert limits is not None and limits.context_length == 512 and limits.input_limit == 512 - 6
    prompt = [5 + index % 50 for index in range(500)]
    params = SamplingParams(temperature=0, max_new_tokens=100, ignore_eos=True)
    (output,) = await client.generate(GenerateRequest("near-the-end", prompt, params))
    reference = TorchEngine.from_pretrained(tiny_model_path)
    try:
        (expected,) = await reference.generate(GenerateRequest("near-the-end", prompt, params))
    finally:
        await reference.close()
    assert output.finish_reason == expected.finish_reason == "length"
    assert output.output_ids == expected.output_ids and len(output.output_ids) == 12
    with pytest.raises(ValueError, match=r"request 'no-room': prompt of 506 tokens leaves no room"):
        await client.generate(GenerateRequest("no-room", [5] * 506, params))


@pytest.mark.integration
async def test_weight_version_is_read_from_model_info(client: SglangEngine, server: ServerProcess) -> None:
    """`/get_weight_version` is gone from SGLang (404 on 0.5.15.post1, absent on 0.5.23)."""
    assert await client.server_weight_version() == 0
    assert await asyncio.to_thread(attached_server_version, server.url, timeout=10) == 0
    assert not await asyncio.to_thread(probe, server.url + "/get_weight_version", 5.0)


@pytest.mark.integration
async def test_seeded_request_to_a_server_without_deterministic_inference_warns(
    client: SglangEngine, caplog: pytest.LogCaptureFixture
) -> None:
    limits = await client.server_limits()
    assert limits is not None and limits.deterministic is False
    with caplog.at_level(logging.WARNING, logger="engines.sglang.client"):
        await client.generate(GenerateRequest("seeded", PROMPT, SamplingParams(seed=3, max_new_tokens=2)))
    assert "ignores sampling_seed" in caplog.text


@pytest.mark.integration
async def test_flush_cache_is_retried_until_the_server_is_idle_and_fails_by_name_at_its_deadline(
    client: SglangEngine, server: ServerProcess
) -> None:
    """SGLang refuses to flush while a request runs; a "retract" pause (sent here by hand) keeps it running."""
    params = SamplingParams(temperature=0, max_new_tokens=500, ignore_eos=True)
    tokens_before = (await server_metrics(server))["sglang:generation_tokens_total"]
    running = asyncio.create_task(client.generate(GenerateRequest("busy", PROMPT, params)))
    await decoding_started(server, tokens_before)
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url + "/pause_generation", json={"mode": "retract"}) as reply:
            assert reply.status == 200
        try:
            with pytest.raises(SglangError, match=r"/flush_cache: the server did not become idle within 0.5s"):
                await client.flush_cache(deadline_s=0.5)
        finally:
            async with http.post(server.url + "/continue_generation", json={}) as reply:
                assert reply.status == 200
    await client.flush_cache(deadline_s=60)  # retried until the server finished the request
    # The server is idle once it has sent the reply; our task may still be reading it, so wait briefly, not forever.
    assert (await asyncio.wait_for(running, timeout=10))[0].finish_reason == "length"


@pytest.mark.integration
async def test_paused_server_fails_generate_health_checks_but_is_not_restarted(
    server: ServerProcess,
) -> None:
    """SGLang's /health generates a token, which waits out a pause: the health loop must not call that a death."""
    client = SglangEngine(server.url, server=server, health_interval=0.2)
    try:
        await client.generate(GenerateRequest("warm", PROMPT, SamplingParams(max_new_tokens=1)))  # starts the watch
        await client.pause("keep")
        for path in ("/health", "/health_generate"):
            assert not await asyncio.to_thread(probe, server.url + path, 5.0)
        await asyncio.sleep(3.0)  # 15 health intervals
        assert client.restarts == 0 and server.alive()
        await client.resume()
        assert await asyncio.to_thread(probe, server.url + "/health", 5.0)
    finally:
        client.server = None  # the fixture stops the server
        await client.close()
