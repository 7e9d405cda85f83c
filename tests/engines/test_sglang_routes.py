"""Routed experts from an SGLang server (routing replay): asked for with `return_routed_experts`, read from
meta_info as base64 int32, and joined across the continuation that resumes a sample a "keep" pause aborted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import pytest

from engines.inference import GenerateRequest, SamplingParams, TorchEngine
from engines.inference.base import RoutedExperts
from engines.sglang import protocol
from engines.sglang.client import MoeRoutes, SglangEngine, joined_routes
from engines.sglang.errors import SglangError
from engines.sglang.launch import ServerProcess, ServerSpec
from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model

PROMPT = [5, 9, 11, 7, 30, 2, 8]
MOE_SHAPE = MoeRoutes(layers=2, moe_layers=(0, 1), top_k=2)  # TinyModelSpec's qwen3_moe


@pytest.fixture(scope="module")
def moe_model(tiny_model_cache: Path) -> Path:
    return cached_tiny_model(tiny_model_cache, TinyModelSpec(family="qwen3_moe"))


def _server(model: Path, logs: Path, *flags: str) -> ServerProcess:
    extra = {"torch-threads": "1", **{flag: "true" for flag in flags}}
    spec = ServerSpec(model_path=str(model), module="tools.standins.sglang_server", random_seed=3, extra=extra)
    return ServerProcess(spec, startup_timeout=120, log_dir=logs)


@pytest.fixture(scope="module")
def routing_server(moe_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = _server(moe_model, tmp_path_factory.mktemp("sglang-logs"), "enable-return-routed-experts")
    process.start()
    yield process
    process.stop()


@pytest.fixture
async def client(routing_server: ServerProcess) -> AsyncIterator[SglangEngine]:
    engine = SglangEngine(routing_server.url, moe_routes=MOE_SHAPE)
    yield engine
    await engine.close()


def table(routes: RoutedExperts | None) -> np.ndarray:
    assert routes is not None
    return np.frombuffer(routes.data, dtype="<i2").reshape(routes.shape)


@pytest.mark.integration
async def test_a_servers_routes_are_the_torch_engines_for_the_same_tokens(client: SglangEngine,
                                                                         moe_model: Path) -> None:
    params = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True, n=2)
    served = await client.generate(GenerateRequest("served", PROMPT, params))
    async with TorchEngine.from_pretrained(moe_model, record_routes=True) as engine:
        local = await engine.generate(GenerateRequest("local", PROMPT, params))
    for mine, theirs in zip(served, local, strict=True):
        assert mine.output_ids == theirs.output_ids
        assert table(mine.routed_experts).shape == (len(PROMPT) + 10 - 1, 2, 2)
        np.testing.assert_array_equal(table(mine.routed_experts), table(theirs.routed_experts))


@pytest.mark.integration
async def test_a_sample_resumed_after_a_keep_pause_keeps_every_tokens_routes(client: SglangEngine) -> None:
    params = SamplingParams(temperature=0, max_new_tokens=200, ignore_eos=True)
    whole = (await client.generate(GenerateRequest("whole", PROMPT, params)))[0]
    task = asyncio.create_task(client.generate(GenerateRequest("paused", PROMPT, params)))
    while client.resumed_requests == 0 and not task.done():
        await client.pause("keep")
        await client.resume()
        await asyncio.sleep(0.05)
    resumed = await task
    assert client.resumed_requests > 0, "the sample finished before any pause reached it"
    assert resumed[0].output_ids == whole.output_ids
    np.testing.assert_array_equal(table(resumed[0].routed_experts), table(whole.routed_experts))


@pytest.mark.integration
async def test_a_server_started_without_the_flag_is_named(moe_model: Path, tmp_path: Path) -> None:
    process = _server(moe_model, tmp_path)
    process.start()
    engine = SglangEngine(process.url, moe_routes=MOE_SHAPE)
    try:
        with pytest.raises(SglangError, match="start the server with --enable-return-routed-experts"):
            await engine.generate(GenerateRequest("r", PROMPT, SamplingParams(temperature=0, max_new_tokens=3)))
    finally:
        await engine.close()
        process.stop()


@pytest.mark.unit
def test_joined_routes_keep_the_first_parts_rows_before_the_continuations() -> None:
    def routes(rows: int, value: int) -> RoutedExperts:
        return RoutedExperts(np.full((rows, 2, 2), value, dtype="<i2").tobytes(), (rows, 2, 2))

    joined = table(joined_routes(routes(6, 1), routes(4, 2), 5))
    assert joined.shape == (9, 2, 2)
    assert (joined[:5] == 1).all() and (joined[5:] == 2).all()
    assert joined_routes(None, routes(4, 2), 0) is not None and joined_routes(None, routes(4, 2), 3) is None
    assert table(joined_routes(routes(6, 1), None, 6)).shape == (6, 2, 2)


@pytest.mark.unit
def test_a_models_dense_layers_rows_are_left_out_of_the_replayed_routes(tmp_path: Path) -> None:
    """SGLang records every decoder layer; a Qwen3-MoE with dense MLP layers replays its MoE layers' rows only."""
    from transformers import Qwen3MoeConfig

    from actors.config import build_config
    from actors.rollout.engine_factory import moe_routes

    Qwen3MoeConfig(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                   mlp_only_layers=[0, 2], vocab_size=100).save_pretrained(tmp_path)
    shape = moe_routes(build_config({"hf_checkpoint": str(tmp_path), "use_rollout_routing_replay": True}))
    assert shape == MoeRoutes(layers=4, moe_layers=(1, 3), top_k=2)
    engine = SglangEngine("http://127.0.0.1:1", moe_routes=shape)
    every_layer = np.arange(3 * 4 * 2, dtype="<i4").reshape(3, 4, 2)  # 3 tokens: a 3-token prompt, 1 output
    parsed = protocol.ParsedOutput([7], [-0.1], "length", None, 0, 3, routed_experts=every_layer.tobytes())
    routes = engine._routes(parsed, GenerateRequest("r", [1, 2, 3], SamplingParams(max_new_tokens=1)), 0,
                            where="output 0")
    np.testing.assert_array_equal(table(routes), every_layer[:, [1, 3]])
