"""A push to SGLang(-compatible) servers that counts on a server the learner's roster says is gone ends within a
second of `abort()`, on both mechanisms, and the next push to the live servers commits.

Real processes: one compatible server in its own process; the sender in this one. "rollout-0-1" is a member
that never answers, as a server killed at that moment would not.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engines.sglang.client import SglangEngine
from engines.sglang.launch import ServerProcess, ServerSpec
from engines.sglang.store_sender import SglangStoreSender
from engines.sglang.tensor_weights import SglangTensorLoader, SglangTensorSender
from engines.sglang.weights import SglangWeightLoader, SglangWeightSender
from engines.weights.base import WeightTransferError
from tests.engines.test_sglang_weights import perturbed_weights, push

ENGINE, GONE = "rollout-0-0", "rollout-0-1"
DIED = {GONE: "died (the roster says)"}
TIMEOUT_S = 20.0  # what the push would wait for the missing server without the abort


@pytest.fixture(scope="module")
def server(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    spec = ServerSpec(model_path=str(tiny_model_path), module="tools.standins.sglang_server",
                      extra={"torch-threads": "1", "weight-group-timeout": str(int(TIMEOUT_S))})
    process = ServerProcess(spec, startup_timeout=120, log_dir=tmp_path_factory.mktemp("sglang-logs"))
    process.start()
    yield process
    process.stop()


async def given_up_within(seconds: float, sender: SglangStoreSender, blocking_call: object) -> WeightTransferError:
    """Run `blocking_call` in a thread, abort the sender one second in, and return the error it raised, checking
    it came within `seconds` of the abort and blames the member the abort named."""
    threading.Timer(1.0, sender.abort, args=(DIED,)).start()
    started = time.monotonic()
    with pytest.raises(WeightTransferError) as failure:
        await asyncio.to_thread(blocking_call)  # type: ignore[arg-type]
    waited = time.monotonic() - started - 1.0
    assert waited < seconds, f"the push went on {waited:.1f}s after the abort"
    assert failure.value.failed == DIED
    return failure.value


@pytest.mark.integration
async def test_a_push_by_reference_waiting_on_a_dead_server_ends_at_the_abort(
    server: ServerProcess, tiny_model_path: Path
) -> None:
    """The store protocol both mechanisms share: the live server said "ready", the dead one never will."""
    client = SglangEngine(server.url)
    sender = SglangTensorSender(host="127.0.0.1", bucket_bytes=64 * 1024, timeout_s=TIMEOUT_S)
    loader = SglangTensorLoader(client, ENGINE)
    named = perturbed_weights(tiny_model_path, seed=5)
    try:
        spec = sender.open_group(["learner", ENGINE, GONE])
        receiving = asyncio.create_task(loader.apply(spec.to_dict(), 1, TIMEOUT_S))
        await asyncio.to_thread(sender.wait_for_receivers)
        error = await given_up_within(1.5, sender, lambda: sender.send(named, 1))
        assert "not started" in str(error)
        with pytest.raises(WeightTransferError, match="given up by the learner"):
            await asyncio.wait_for(receiving, 5.0)  # the live server's worker is told, not left to its timeout
        assert sender.committed_version is None

        await push(sender, loader, named, 2, fresh=True)
        assert sender.committed_version == 2 and client.version == 2
    finally:
        sender.close()
        await client.close()


@pytest.mark.integration
async def test_a_broadcast_group_waiting_on_a_dead_server_gives_up_at_the_abort(
    server: ServerProcess, tiny_model_path: Path
) -> None:
    """Formation: the live server joined the learner's gloo group, the dead one never will. Neither the learner nor
    the live server waits out the group timeout."""
    client = SglangEngine(server.url)
    sender = SglangWeightSender(host="127.0.0.1", backend="gloo", timeout_s=TIMEOUT_S)
    loader = SglangWeightLoader(client, ENGINE)
    named = perturbed_weights(tiny_model_path, seed=6)
    try:
        spec = sender.open_group(["learner", ENGINE, GONE])
        receiving = asyncio.create_task(loader.apply(spec.to_dict(), 3, TIMEOUT_S))
        await given_up_within(1.5, sender, sender.wait_for_receivers)
        # The learner's store went with the group, so the live server's join fails now, not at its own timeout.
        with pytest.raises(WeightTransferError):
            await asyncio.wait_for(receiving, 5.0)

        await push(sender, loader, named, 4, fresh=True)
        assert sender.committed_version == 4 and client.version == 4
    finally:
        sender.close()
        await client.close()
