"""A colocated SGLang(-compatible) server: weights by reference, and memory released and resumed between turns.

Real processes: the compatible server runs in its own process and opens the learner's shared memory by name;
the learner-side sender hosts its store in this one. Nothing is broadcast.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engines.inference.base import GenerateRequest, SamplingParams
from engines.inference.torch_engine import TorchEngine
from engines.sglang import protocol
from engines.sglang.client import SglangEngine, SglangError
from engines.sglang.launch import ServerProcess, ServerSpec
from engines.sglang.tensor_weights import SglangTensorLoader, SglangTensorSender
from engines.weights.base import WeightTransferError
from engines.weights.stream import SpecifiedTensors, record_specs
from tests.engines.test_sglang_weights import perturbed_weights, push

PROMPT = [7, 21, 33, 4, 18]
GREEDY = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
ENGINE = "rollout-0-0"
KV_ONLY = (protocol.MEMORY_KV_CACHE, protocol.MEMORY_CUDA_GRAPH)


def launch(model: Path, logs: Path, *extra_flags: str) -> ServerProcess:
    extra: dict[str, str | list[str]] = {"torch-threads": "1"}
    extra.update({flag: "true" for flag in extra_flags})
    process = ServerProcess(ServerSpec(model_path=str(model), module="tools.standins.sglang_server", extra=extra),
                            startup_timeout=120, log_dir=logs)
    process.start()
    return process


@pytest.fixture(scope="module")
def server(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = launch(tiny_model_path, tmp_path_factory.mktemp("sglang-logs"), "enable-memory-saver",
                     "enable-weights-cpu-backup")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def server_without_backup(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A memory saver that backs nothing up: released weights come back as garbage, so the test that shows it
    comes last among this server's."""
    process = launch(tiny_model_path, tmp_path_factory.mktemp("sglang-logs"), "enable-memory-saver")
    yield process
    process.stop()


def shared_segments() -> set[str]:
    """The named shared-memory segments this process made (torch names them after the creating pid)."""
    return {name for name in os.listdir("/dev/shm") if name.startswith(f"torch_{os.getpid()}_")}


@pytest.mark.integration
async def test_weights_by_reference_reach_the_server_and_tag_later_tokens(
    server: ServerProcess, tiny_model_path: Path
) -> None:
    client = SglangEngine(server.url)
    sender = SglangTensorSender(host="127.0.0.1", bucket_bytes=64 * 1024, timeout_s=20)
    loader = SglangTensorLoader(client, ENGINE)
    named = perturbed_weights(tiny_model_path, seed=1)
    reference = TorchEngine.from_pretrained(tiny_model_path)
    segments_before = shared_segments()
    try:
        before = (await client.generate(GenerateRequest("before", PROMPT, GREEDY)))[0]
        await push(sender, loader, named, 1, fresh=True)
        assert sender.committed_version == 1 and client.version == 1
        await reference.update_weights(named, 1)
        expected = (await reference.generate(GenerateRequest("after", PROMPT, GREEDY)))[0]
        after = (await client.generate(GenerateRequest("after", PROMPT, GREEDY)))[0]
        assert after.output_ids == expected.output_ids != before.output_ids
        assert after.log_probs == pytest.approx(expected.log_probs, abs=1e-5)
        assert after.versions == [1] * len(after.output_ids)
        assert await client.server_weight_version() == 1
        assert len(shared_segments() - segments_before) == 1  # one staging buffer, reused bucket after bucket
    finally:
        sender.close()
        await reference.close()
        await client.close()
    assert shared_segments() <= segments_before  # and it went with the sender


@pytest.mark.integration
async def test_a_bucket_the_server_refuses_fails_the_push_and_leaves_the_version(
    server: ServerProcess, tiny_model_path: Path
) -> None:
    client = SglangEngine(server.url)
    sender = SglangTensorSender(host="127.0.0.1", bucket_bytes=64 * 1024, timeout_s=20)
    loader = SglangTensorLoader(client, ENGINE)
    version_before = await client.server_weight_version()
    try:
        with pytest.raises(WeightTransferError, match=rf"{ENGINE}.*no_such_layer"):
            await push(sender, loader, [("model.no_such_layer.weight", torch.zeros(4, 4))], 9, fresh=True)
        assert sender.committed_version is None
        assert await client.server_weight_version() == version_before
    finally:
        sender.close()
        await client.close()


@pytest.mark.integration
async def test_learner_tensors_that_break_mid_push_free_the_server_at_once(
    server: ServerProcess, tiny_model_path: Path
) -> None:
    client = SglangEngine(server.url)
    sender = SglangTensorSender(host="127.0.0.1", bucket_bytes=16 * 1024, timeout_s=20)
    loader = SglangTensorLoader(client, ENGINE)
    named = perturbed_weights(tiny_model_path, seed=3)
    specs = record_specs(named)

    def breaking() -> Iterator[tuple[str, torch.Tensor]]:
        for index, pair in enumerate(named):
            if index == len(named) // 2:
                raise RuntimeError("gather failed on rank 1")
            yield pair

    try:
        with pytest.raises(WeightTransferError, match="broke"):
            await asyncio.wait_for(push(sender, loader, SpecifiedTensors(specs, breaking()), 4, fresh=True), 15)
        assert await client.server_weight_version() != 4
        await push(sender, loader, named, 5, fresh=True)  # the next push commits
        assert await client.server_weight_version() == 5
    finally:
        sender.close()
        await client.close()


@pytest.mark.integration
async def test_released_memory_is_taken_back_before_generation_and_before_a_weight_load(
    server: ServerProcess, tiny_model_path: Path
) -> None:
    client = SglangEngine(server.url, release_tags=protocol.MEMORY_TAGS)
    raw = SglangEngine(server.url)  # releases nothing by itself: shows what the server refuses
    sender = SglangTensorSender(host="127.0.0.1", timeout_s=20)
    loader = SglangTensorLoader(client, ENGINE)
    try:
        first = (await client.generate(GenerateRequest("one", PROMPT, GREEDY)))[0]
        await client.on_idle()
        assert client.released_memory == protocol.MEMORY_TAGS and client.memory_releases == 1
        with pytest.raises(SglangError, match="memory is released"):
            await raw.generate(GenerateRequest("refused", PROMPT, GREEDY))
        # generation resumes everything first; the backed-up weights come back as they were
        again = (await client.generate(GenerateRequest("two", PROMPT, GREEDY)))[0]
        assert again.output_ids == first.output_ids and client.released_memory == ()

        await client.on_idle()
        await push(sender, loader, perturbed_weights(tiny_model_path, seed=4), 6, fresh=True)
        assert client.released_memory == (protocol.MEMORY_KV_CACHE, protocol.MEMORY_CUDA_GRAPH)  # weights back
        assert await client.server_weight_version() == 6
        assert (await client.generate(GenerateRequest("three", PROMPT, GREEDY)))[0].versions[0] == 6
        assert client.released_memory == ()
    finally:
        sender.close()
        await raw.close()
        await client.close()


@pytest.mark.integration
async def test_a_release_waits_for_nothing_in_flight_and_never_overlaps_a_request(server: ServerProcess) -> None:
    client = SglangEngine(server.url, release_tags=KV_ONLY)
    long = SamplingParams(temperature=0, max_new_tokens=60, ignore_eos=True)
    try:
        running = asyncio.create_task(client.generate(GenerateRequest("long", PROMPT, long)))
        while (await client.health())["requests"] == 0:
            await asyncio.sleep(0.01)
        await client.on_idle()  # a request of ours is in flight: nothing is released
        assert client.released_memory == () and client.memory_releases == 0
        assert len((await running)[0].output_ids) == 60
        racing = [client.on_idle(), client.generate(GenerateRequest("racing", PROMPT, GREEDY))]
        outputs = (await asyncio.gather(*racing))[1]
        assert len(outputs[0].output_ids) == 10
    finally:
        await client.close()


@pytest.mark.integration
async def test_nothing_is_released_while_a_weight_load_holds_the_memory(server: ServerProcess) -> None:
    client = SglangEngine(server.url, release_tags=KV_ONLY)
    try:
        async with client.memory_pinned():
            await client.on_idle()
            assert client.released_memory == ()
        await client.on_idle()
        assert client.released_memory == KV_ONLY
        await client.take_back_memory()
        assert client.released_memory == ()
    finally:
        await client.close()


@pytest.mark.integration
async def test_health_checks_leave_released_memory_alone(server_without_backup: ServerProcess) -> None:
    """SGLang's /health generates a token: while memory is released the loop checks /model_info instead, so a
    server that handed its memory over is neither faulted by a check nor restarted as unhealthy."""
    process = server_without_backup
    client = SglangEngine(process.url, server=process, release_tags=KV_ONLY, health_interval=0.05)
    try:
        await client.generate(GenerateRequest("first", PROMPT, GREEDY))  # starts the health loop
        for _ in range(20):  # releases racing the checks: each finds the server idle
            await client.on_idle()
            assert client.released_memory == KV_ONLY
            await asyncio.sleep(0.05)
            await client.take_back_memory()
        await client.on_idle()
        await asyncio.sleep(0.5)  # ten checks while released
        assert client.restarts == 0 and client.memory_releases == 21
        assert (await client.generate(GenerateRequest("after", PROMPT, GREEDY)))[0].output_ids
    finally:
        client.server = None  # the module fixture stops the server
        await client.close()


async def released_once_idle(client: SglangEngine, deadline_s: float = 30.0) -> None:
    """`client.on_idle()` once the server is idle, as SGLang requires: the module's previous test closed a client
    whose health check (a generated token) may still run on the server (CI: 'should be called only when server is
    idle')."""
    give_up = asyncio.get_running_loop().time() + deadline_s
    while True:
        try:
            await client.on_idle()
            return
        except SglangError as error:
            if "only when server is idle" not in str(error) or asyncio.get_running_loop().time() > give_up:
                raise
        await asyncio.sleep(0.05)


@pytest.mark.integration
async def test_weights_released_without_a_backup_come_back_unusable(server_without_backup: ServerProcess) -> None:
    """Why a run releases weights only where the server backs them up: SGLang frees them, contents and all.
    Last in this module: the server it leaves behind serves garbage."""
    client = SglangEngine(server_without_backup.url, release_tags=protocol.MEMORY_TAGS)
    try:
        await released_once_idle(client)
        with pytest.raises(protocol.ProtocolError, match="non-finite"):  # NaN weights, NaN log-probs
            await client.generate(GenerateRequest("garbage", PROMPT, GREEDY))
    finally:
        await client.close()
