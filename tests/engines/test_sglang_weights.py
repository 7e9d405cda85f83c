"""Weights into an SGLang(-compatible) server over gloo, the way SGLang receives them, and server restarts.

Real processes throughout: the compatible server in its own process joins the group the learner-side sender
hosts in this one, and receives one broadcast per tensor per `/update_weights_from_distributed` call.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from engines.inference.base import GenerateRequest, SamplingParams
from engines.inference.torch_engine import TorchEngine
from engines.sglang.client import SglangEngine, SglangError
from engines.sglang.launch import ServerProcess, ServerSpec
from engines.sglang.weights import SglangWeightLoader, SglangWeightSender
from engines.weights.base import WeightTransferError
from engines.weights.manifest import plan_buckets
from engines.weights.stream import SpecifiedTensors, record_specs

PROMPT = [7, 21, 33, 4, 18]
GREEDY = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
ENGINE = "rollout-0-0"


def compat_server(model_path: Path, log_dir: Path, **flags: str) -> Iterator[ServerProcess]:
    """The compatible server on `model_path` for a module's tests, with `flags` beside the usual ones."""
    spec = ServerSpec(
        model_path=str(model_path),
        module="tools.standins.sglang_server",
        extra={"torch-threads": "1", "weight-group-timeout": "20", **flags},
    )
    process = ServerProcess(spec, startup_timeout=120, log_dir=log_dir)
    process.start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def server(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from compat_server(tiny_model_path, tmp_path_factory.mktemp("sglang-logs"))


def perturbed_weights(path: Path, seed: int) -> list[tuple[str, torch.Tensor]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return [(name, tensor.detach().clone()) for name, tensor in model.state_dict().items()]


async def push(sender: SglangWeightSender, loader: SglangWeightLoader, named: list, version: int, fresh: bool) -> None:
    """One version from `sender` to `loader`'s server; `fresh`: in a new group (else the open one, joined or not)."""
    spec = sender.spec if not fresh else sender.open_group(["learner", ENGINE])
    assert spec is not None
    receiving = asyncio.create_task(loader.apply(spec.to_dict(), version, 20.0))
    try:
        if fresh:
            await asyncio.to_thread(sender.wait_for_receivers)
        await asyncio.to_thread(sender.send, named, version)
    finally:
        await asyncio.gather(receiving, return_exceptions=True)
    if receiving.exception() is not None:
        raise receiving.exception()


@pytest.mark.integration
async def test_weight_update_over_gloo_reaches_the_server_and_tags_later_tokens(
    server: ServerProcess, tiny_model_path: Path
) -> None:
    client = SglangEngine(server.url)
    sender = SglangWeightSender(host="127.0.0.1", backend="gloo", bucket_bytes=64 * 1024, timeout_s=20)
    loader = SglangWeightLoader(client, ENGINE)
    named = perturbed_weights(tiny_model_path, seed=1)
    reference = TorchEngine.from_pretrained(tiny_model_path)
    try:
        before = (await client.generate(GenerateRequest("before", PROMPT, GREEDY)))[0]
        await push(sender, loader, named, version=1, fresh=True)
        assert sender.committed_version == 1 and client.version == 1
        await reference.update_weights(named, 1)
        expected = (await reference.generate(GenerateRequest("after", PROMPT, GREEDY)))[0]
        after = (await client.generate(GenerateRequest("after", PROMPT, GREEDY)))[0]
        assert after.output_ids == expected.output_ids != before.output_ids
        assert after.log_probs == pytest.approx(expected.log_probs, abs=1e-5)
        assert after.versions == [1] * len(after.output_ids)
        assert await client.server_weight_version() == 1

        # The same group carries the next version: no new rendezvous.
        await push(sender, loader, perturbed_weights(tiny_model_path, seed=2), version=2, fresh=False)
        assert sender.committed_version == 2 and await client.server_weight_version() == 2
    finally:
        sender.close()
        await reference.close()
        await client.close()


@pytest.mark.integration
async def test_every_version_reaches_the_server_after_a_flush_of_its_cache(
    server: ServerProcess, tiny_model_path: Path
) -> None:
    """SGLang's prefix cache is keyed by tokens, not weights: a prefix computed by version v would serve v + 1. The
    loader flushes it before each version's first bucket, and asks no bucket to flush (SGLang 0.5.15 takes its server
    down when a flush asked of an update fails)."""
    client = SglangEngine(server.url)
    sender = SglangWeightSender(host="127.0.0.1", backend="gloo", bucket_bytes=64 * 1024, timeout_s=20)
    loader = SglangWeightLoader(client, ENGINE)
    calls: list[str] = []

    def recorded(name: str, method: Any) -> Any:
        async def call(*args: Any, **kwargs: Any) -> Any:
            result = await method(*args, **kwargs)  # the server's own answer: a refused flush raises, unrecorded
            calls.append(name if name != "update" else f"update flush_cache={kwargs['flush_cache']}")
            return result
        return call

    client.flush_cache = recorded("flush", client.flush_cache)  # type: ignore[method-assign]
    client.update_weights_from_distributed = recorded(  # type: ignore[method-assign]
        "update", client.update_weights_from_distributed)
    try:
        for version in (1, 2):
            calls.append(f"version {version}")
            await push(sender, loader, perturbed_weights(tiny_model_path, seed=version), version, fresh=version == 1)
    finally:
        sender.close()
        await client.close()
    for version in ("version 1", "version 2"):
        after = calls[calls.index(version) + 1:]
        assert after[0] == "flush" and after[1].startswith("update"), calls
    assert {call for call in calls if call.startswith("update")} == {"update flush_cache=False"}


@pytest.mark.integration
async def test_weights_the_server_refuses_are_not_committed(server: ServerProcess, tiny_model_path: Path) -> None:
    client = SglangEngine(server.url)
    sender = SglangWeightSender(host="127.0.0.1", backend="gloo", timeout_s=20)
    loader = SglangWeightLoader(client, ENGINE)
    named = [("model.no_such_layer.weight", torch.zeros(4, 4))]
    try:
        with pytest.raises(WeightTransferError, match=rf"{ENGINE}.*no_such_layer"):
            await push(sender, loader, named, version=7, fresh=True)
        assert sender.committed_version is None
        assert await client.server_weight_version() != 7
        # The loader destroyed the failed group on the server (SGLang keeps a group until told otherwise).
        assert sender.spec is not None
        with pytest.raises(SglangError, match="no group"):
            await client.destroy_weights_update_group(sender.spec.group_name)
    finally:
        sender.close()
        await client.close()


@pytest.mark.integration
async def test_killed_server_is_restarted_and_its_in_flight_request_returns_aborted(server: ServerProcess) -> None:
    """Last in this module: the server it leaves behind is the restarted one."""
    client = SglangEngine(server.url, server=server, health_interval=0.3)
    try:
        await client.generate(GenerateRequest("warm", PROMPT, SamplingParams(max_new_tokens=1)))  # starts the watch
        # Paused with "keep", the server holds the request, so it is certainly in flight when the server dies
        # (unpaused, a fast machine finished it before the kill).
        await client.pause("keep")
        long = GenerateRequest("long", PROMPT, SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True))
        task = asyncio.create_task(client.generate(long))
        await asyncio.sleep(0.5)
        assert not task.done()
        assert server.process is not None
        os.killpg(server.process.pid, signal.SIGKILL)
        outputs = await asyncio.wait_for(task, 30)
        assert outputs[0].finish_reason == "abort"
        for _ in range(600):
            if client.restarts == 1 and server.alive():
                break
            await asyncio.sleep(0.1)
        assert client.restarts == 1 and client.version == 0
        await client.resume()
        again = await asyncio.wait_for(client.generate(GenerateRequest("again", PROMPT, GREEDY)), 30)
        assert len(again[0].output_ids) == GREEDY.max_new_tokens
    finally:
        client.server = None  # the module fixture stops the server
        await client.close()


@pytest.mark.integration
async def test_request_in_flight_during_an_update_finishes_with_each_tokens_own_version(
    server: ServerProcess, tiny_model_path: Path
) -> None:
    """The loader pauses with SGLang's "abort" mode; the client resumes the request, and 0.5.23's per-token
    `weight_versions` spans tag the tokens before the update with the old version and after it with the new."""
    client = SglangEngine(server.url)
    sender = SglangWeightSender(host="127.0.0.1", backend="gloo", timeout_s=20)
    loader = SglangWeightLoader(client, ENGINE)
    long = GenerateRequest("long", PROMPT, SamplingParams(temperature=0, max_new_tokens=480, ignore_eos=True))
    try:
        await push(sender, loader, perturbed_weights(tiny_model_path, seed=3), version=1, fresh=True)
        task = asyncio.create_task(client.generate(long))
        await asyncio.sleep(0.1)
        await push(sender, loader, perturbed_weights(tiny_model_path, seed=4), version=2, fresh=False)
        (output,) = await asyncio.wait_for(task, 60)
    finally:
        sender.close()
        await client.close()
    assert output.finish_reason == "length" and len(output.output_ids) == 480
    assert client.resumed_requests >= 1
    first_new = output.versions.index(2)
    assert first_new > 0 and output.versions == [1] * first_new + [2] * (480 - first_new)


@pytest.mark.integration
async def test_a_session_left_open_by_a_failed_update_is_ended_before_the_next(
    server: ServerProcess, tiny_model_path: Path
) -> None:
    client = SglangEngine(server.url)
    sender = SglangWeightSender(host="127.0.0.1", backend="gloo", timeout_s=20)
    loader = SglangWeightLoader(client, ENGINE)
    try:
        assert await client.begin_weight_update()  # and never ended, as by an update that died half-way
        await push(sender, loader, perturbed_weights(tiny_model_path, seed=5), version=3, fresh=True)
        assert sender.committed_version == 3 and await client.server_weight_version() == 3
    finally:
        sender.close()
        await client.close()


@pytest.fixture(scope="module")
def server_0_5_15(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The compatible server as SGLang 0.5.15.post1 behaves: no weight-update sessions, and a weight update
    asked to flush the cache while requests are still in the scheduler takes the server down."""
    yield from compat_server(tiny_model_path, tmp_path_factory.mktemp("sglang-logs"), **{"sglang-api": "0.5.15.post1"})


@pytest.mark.integration
async def test_update_on_a_release_without_sessions_keeps_the_server_and_its_request_alive(
    server_0_5_15: ServerProcess, tiny_model_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """0.5.15: /begin_weight_update answers 404 (logged fallback); pausing in "retract" mode and flushing with
    the last bucket would kill this server, so the request in flight would never finish."""
    client = SglangEngine(server_0_5_15.url)
    sender = SglangWeightSender(host="127.0.0.1", backend="gloo", timeout_s=20)
    loader = SglangWeightLoader(client, ENGINE)
    long = GenerateRequest("long", PROMPT, SamplingParams(temperature=0, max_new_tokens=480, ignore_eos=True))
    try:
        with caplog.at_level(logging.INFO, logger="engines.sglang.client"):
            await push(sender, loader, perturbed_weights(tiny_model_path, seed=6), version=1, fresh=True)
        assert "updating weights without one" in caplog.text
        task = asyncio.create_task(client.generate(long))
        await asyncio.sleep(0.1)
        await push(sender, loader, perturbed_weights(tiny_model_path, seed=7), version=2, fresh=False)
        (output,) = await asyncio.wait_for(task, 60)
        assert server_0_5_15.alive() and await client.server_weight_version() == 2
    finally:
        sender.close()
        await client.close()
    assert output.finish_reason == "length" and len(output.output_ids) == 480
    # No spans from this release: every token carries the oldest version the request may have seen.
    assert set(output.versions) == {1}


@pytest.mark.integration
async def test_a_learner_source_that_breaks_mid_way_leaves_the_server_out_of_the_call_and_the_next_push_commits(
    server: ServerProcess, tiny_model_path: Path
) -> None:
    """The learner pulls each bucket's tensors only when it goes out (a gathering trainer holds one bucket, not
    the model). When its source fails at bucket 3, the loader hears so before posting bucket 3's call: no server
    is left inside `/update_weights_from_distributed` waiting for a broadcast that will not come (on NCCL, until
    its watchdog)."""
    client = SglangEngine(server.url)
    sender = SglangWeightSender(host="127.0.0.1", backend="gloo", bucket_bytes=8 * 1024, timeout_s=20)
    loader = SglangWeightLoader(client, ENGINE)
    named = perturbed_weights(tiny_model_path, seed=3)
    specs = record_specs(iter(named))
    buckets = plan_buckets(specs, 8 * 1024, 8 * 1024)
    assert len(buckets) > 3
    breaks_at = buckets[2].entries[0][0]  # the first tensor of the third bucket

    def breaking() -> Iterator[tuple[str, torch.Tensor]]:
        for index, item in enumerate(named):
            if index == breaks_at:
                raise RuntimeError("all-gather failed")
            yield item

    reference = TorchEngine.from_pretrained(tiny_model_path)
    try:
        spec = sender.open_group(["learner", ENGINE])
        receiving = asyncio.create_task(loader.apply(spec.to_dict(), 4, 20.0))
        await asyncio.to_thread(sender.wait_for_receivers)
        where = f"bucket 3/{len(buckets)}"
        with pytest.raises(WeightTransferError, match=rf"{where} broke.*{named[breaks_at][0]}.*all-gather"):
            await asyncio.to_thread(sender.send, SpecifiedTensors(specs, breaking()), 4)
        with pytest.raises(WeightTransferError, match=rf"{where} not sent: abort: the learner's tensors broke"):
            await asyncio.wait_for(receiving, 10)
        # Two buckets loaded, but the server does not claim the version nobody committed.
        assert sender.committed_version is None and await client.server_weight_version() != 4

        await push(sender, loader, named, version=5, fresh=True)
        assert sender.committed_version == 5 and await client.server_weight_version() == 5
        await reference.update_weights(named, 5)
        expected = (await reference.generate(GenerateRequest("after", PROMPT, GREEDY)))[0]
        after = (await client.generate(GenerateRequest("after", PROMPT, GREEDY)))[0]
        assert after.output_ids == expected.output_ids and after.versions == [5] * len(after.output_ids)
    finally:
        sender.close()
        await reference.close()
        await client.close()
