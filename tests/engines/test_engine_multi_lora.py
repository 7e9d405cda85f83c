"""The torch engine serves named LoRA adapters unmerged: a batch mixing adapters decodes what each request decodes
alone, and what the engine with that adapter merged decodes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from actors.rollout.engine_calls import request_from_wire, request_to_wire
from bus.codec import decode, encode
from bus.schema import EngineGenerate
from engines.inference import GenerateRequest, SamplingParams, TorchEngine
from engines.inference.batcher import StepRecord
from tests.support.adapters import random_adapter

pytestmark = pytest.mark.integration
SCALING = 2.0
GREEDY = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
SHARED = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]  # longer than the shared-prefix forward's minimum
# (adapter, prompt): the same prompt under each adapter and the base, all sharing a prefix a batch of base rows
# would prefill once.
REQUESTS = [("a", [*SHARED, 46]), ("b", [*SHARED, 46]), (None, [*SHARED, 46]), ("b", [*SHARED, 26, 43]),
            ("a", [*SHARED, 7, 12, 30]), (None, [*SHARED, 50, 2])]


def _engine(path: Path, **options: object) -> TorchEngine:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return TorchEngine(model, None, lora_scaling=SCALING, **options)  # type: ignore[arg-type]


async def _greedy(engine: TorchEngine, request_id: str, adapter: str | None, prompt: list[int]) -> list[int]:
    (output,) = await engine.generate(GenerateRequest(request_id, prompt, GREEDY, adapter=adapter))
    return list(output.output_ids)


async def _until_in_flight(engine: TorchEngine, requests: int) -> None:
    """Until the engine holds `requests` requests (submitted; while paused, none of them steps)."""
    while (await engine.health())["requests"] < requests:
        await asyncio.sleep(0.01)


async def test_a_batch_mixing_adapters_decodes_what_each_request_decodes_alone(tiny_model_path: Path) -> None:
    steps: list[StepRecord] = []
    engine = _engine(tiny_model_path, step_listener=steps.append)
    adapters = {name: random_adapter(engine.model, 4, seed, scale=0.5) for name, seed in (("a", 1), ("b", 2))}
    merged = {name: _engine(tiny_model_path) for name in adapters}
    try:
        for name, tensors in adapters.items():
            await engine.update_weights(tensors, 1, adapter=name)
            await merged[name].update_weights(tensors, 1)  # today's path: the adapter folded into the weights
        await engine.pause()
        mixed = [asyncio.create_task(_greedy(engine, f"mixed-{i}", adapter, prompt))
                 for i, (adapter, prompt) in enumerate(REQUESTS)]
        await _until_in_flight(engine, len(REQUESTS))
        await engine.resume()
        together = await asyncio.gather(*mixed)
        assert any(len(record.decoded) == len(REQUESTS) for record in steps)  # they did decode in one batch
        for i, ((adapter, prompt), tokens) in enumerate(zip(REQUESTS, together, strict=True)):
            assert tokens == await _greedy(engine, f"alone-{i}", adapter, prompt), (adapter, prompt)
            if adapter is not None:
                assert tokens == await _greedy(merged[adapter], f"merged-{i}", None, prompt), (adapter, prompt)
        assert len({tuple(tokens) for tokens in together[:3]}) == 3  # a, b and the base decode differently
    finally:
        await engine.close()
        for other in merged.values():
            await other.close()


async def test_replacing_one_adapter_leaves_the_others_decodes_alone(tiny_model_path: Path) -> None:
    engine = _engine(tiny_model_path)
    try:
        await engine.update_weights(random_adapter(engine.model, 4, 1, scale=0.5), 1, adapter="a")
        await engine.update_weights(random_adapter(engine.model, 4, 2, scale=0.5), 1, adapter="b")
        before = {name: await _greedy(engine, f"{name}-1", name, SHARED) for name in ("a", "b")}
        await engine.update_weights(random_adapter(engine.model, 4, 3, scale=0.5), 2, adapter="a")
        assert await _greedy(engine, "b-2", "b", SHARED) == before["b"]
        assert await _greedy(engine, "a-2", "a", SHARED) != before["a"]
    finally:
        await engine.close()


async def test_adapter_requests_and_loads_the_engine_cannot_serve_are_refused_by_name(tiny_model_path: Path) -> None:
    engine = _engine(tiny_model_path)
    static = _engine(tiny_model_path, kv_cache="static")
    tensors = random_adapter(engine.model, 4, 1)
    try:
        with pytest.raises(ValueError, match=r"request 'r': adapter 'c' is not loaded on this engine \(loaded: \[\]"):
            await _greedy(engine, "r", "c", SHARED)
        with pytest.raises(ValueError, match="adapter must be a non-empty string or None"):
            GenerateRequest("r", SHARED, GREEDY, adapter="")
        with pytest.raises(ValueError, match=r"adapter 'a': 'lm_head\.weight' is not a LoRA factor"):
            await engine.update_weights([*tensors, ("lm_head.weight", torch.zeros(1))], 1, adapter="a")
        with pytest.raises(ValueError, match="adapter 'a': kv_cache='static' does not serve named adapters"):
            await static.update_weights(tensors, 1, adapter="a")
        with pytest.raises(ValueError, match="adapter 'a': kv_cache='static' does not serve named adapters"):
            await _greedy(static, "r", "a", SHARED)
        assert engine.version == 0
    finally:
        await engine.close()
        await static.close()


async def test_a_request_routed_to_another_workers_engine_keeps_its_adapter(tiny_model_path: Path) -> None:
    """Through the wire message and the msgpack codec, as the router sends it and the engine service decodes it."""
    request = GenerateRequest("r", SHARED, GREEDY, adapter="b")
    call = decode(encode(request_to_wire(request)))
    assert isinstance(call, EngineGenerate)
    received = request_from_wire(call)
    assert received.adapter == "b"
    engine = _engine(tiny_model_path)
    try:
        await engine.update_weights(random_adapter(engine.model, 4, 2, scale=0.5), 1, adapter="b")
        assert await _greedy(engine, "routed", received.adapter, received.input_ids) == await _greedy(
            engine, "local", "b", SHARED)
    finally:
        await engine.close()


async def test_an_adapter_is_unloaded_only_once_no_request_of_it_is_in_flight(tiny_model_path: Path) -> None:
    engine = _engine(tiny_model_path)
    try:
        for name, seed in (("a", 1), ("b", 2)):
            await engine.update_weights(random_adapter(engine.model, 4, seed, scale=0.5), 1, adapter=name)
        b_alone = await _greedy(engine, "b-0", "b", SHARED)
        await engine.pause()
        waiting = asyncio.create_task(_greedy(engine, "a-1", "a", SHARED))
        await _until_in_flight(engine, 1)
        with pytest.raises(ValueError, match=r"unload_adapter: adapter 'a' serves 1 requests in flight \('a-1'\)"):
            await engine.unload_adapter("a")
        await engine.resume()
        await waiting
        await engine.unload_adapter("a")
        with pytest.raises(ValueError, match=r"adapter 'a' is not loaded on this engine \(loaded: \['b'\]"):
            await _greedy(engine, "a-2", "a", SHARED)
        with pytest.raises(ValueError, match=r"unload_adapter: adapter 'a' is not served \(served: \['b'\]\)"):
            await engine.unload_adapter("a")
        assert await _greedy(engine, "b-1", "b", SHARED) == b_alone
    finally:
        await engine.close()


async def test_an_adapter_served_at_run_time_is_the_base_model_until_loaded_and_leaves_when_unloaded(
        tiny_model_path: Path) -> None:
    """A policy joining a running job: its adapter is served fresh (the base weights, version 0) beside the loaded
    ones, takes a load like any other, and a policy leaving unloads it whether or not it was ever loaded; the
    engine's slots bound how many it serves."""
    engine = _engine(tiny_model_path, max_adapters=2)
    try:
        await engine.update_weights(random_adapter(engine.model, 4, 1, scale=0.5), 1, adapter="a")
        base = await _greedy(engine, "base", None, SHARED)
        with pytest.raises(ValueError, match="adapter 'joined' is not loaded on this engine"):
            await _greedy(engine, "early", "joined", SHARED)
        engine.serve_adapter("joined")
        engine.serve_adapter("joined")  # asked again (a roster heard twice): nothing changes
        assert await _greedy(engine, "fresh", "joined", SHARED) == base and engine.adapter_version("joined") == 0
        with pytest.raises(ValueError, match=r"adapter 'third': the engine serves 2 adapters \(a, joined\)"):
            engine.serve_adapter("third")
        await engine.update_weights(random_adapter(engine.model, 4, 3, scale=0.5), 4, adapter="joined")
        assert engine.adapter_version("joined") == 4
        assert await _greedy(engine, "loaded", "joined", SHARED) != base
        await engine.unload_adapter("joined")
        engine.serve_adapter("again")  # its slot is free again; a fresh adapter leaves as well
        await engine.unload_adapter("again")
        with pytest.raises(ValueError, match="adapter 'again' is not loaded on this engine"):
            await _greedy(engine, "gone", "again", SHARED)
    finally:
        await engine.close()
