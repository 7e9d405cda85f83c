"""Each named adapter of a torch engine has its own policy version: its rows' tokens carry it, an update of it lands in
its rows only, and the prefix cache never hands one policy's keys and values to another."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engines.inference import GenerateOutput, GenerateRequest, SamplingParams, TorchEngine
from engines.inference.batcher import StepRecord
from tests.support.adapters import random_adapter

pytestmark = pytest.mark.integration
SCALING = 2.0
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]


def _engine(path: Path, **options: object) -> TorchEngine:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return TorchEngine(model, None, lora_scaling=SCALING, **options)  # type: ignore[arg-type]


def _greedy(tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=tokens, ignore_eos=True)


async def _one(engine: TorchEngine, request_id: str, adapter: str | None, tokens: int = 8) -> GenerateOutput:
    (output,) = await engine.generate(GenerateRequest(request_id, PROMPT, _greedy(tokens), adapter=adapter))
    return output


async def test_each_adapter_tags_its_tokens_with_its_own_version(tiny_model_path: Path) -> None:
    engine = _engine(tiny_model_path)
    try:
        await engine.update_weights(random_adapter(engine.model, 4, 1, scale=0.5), 3, adapter="a")
        await engine.update_weights(random_adapter(engine.model, 4, 2, scale=0.5), 5, adapter="b")
        outputs = await asyncio.gather(*(_one(engine, f"r-{adapter}", adapter) for adapter in ("a", "b", None)))
        assert [set(output.versions) for output in outputs] == [{3}, {5}, {0}]
        assert (engine.version, engine.adapter_version("a"), engine.adapter_version("b")) == (0, 3, 5)
        assert engine.adapter_version("never-loaded") == 0
        assert (await engine.health())["adapter_versions"] == {"a": 3, "b": 5}
    finally:
        await engine.close()


async def test_an_update_of_one_adapter_mid_generation_shows_in_its_own_rows_only(tiny_model_path: Path) -> None:
    third_step = threading.Event()

    def listen(record: StepRecord) -> None:
        if record.step >= 3:
            third_step.set()

    engine = _engine(tiny_model_path, step_listener=listen)
    update = random_adapter(engine.model, 4, 3, scale=0.5)
    try:
        await engine.update_weights(random_adapter(engine.model, 4, 1, scale=0.5), 1, adapter="a")
        await engine.update_weights(random_adapter(engine.model, 4, 2, scale=0.5), 1, adapter="b")
        running = [asyncio.create_task(_one(engine, f"r-{adapter}", adapter, tokens=40)) for adapter in ("a", "b")]
        await asyncio.to_thread(third_step.wait)
        await engine.update_weights(update, 2, adapter="a")
        a, b = await asyncio.gather(*running)
        assert a.versions[0] == 1 and a.versions[-1] == 2 and a.versions == sorted(a.versions)
        assert set(b.versions) == {1}
        # a's rows were prefilled again with its new factors; b's kept their keys and values
        assert a.reprefilled_tokens > 0 and b.reprefilled_tokens == 0
        assert engine.kv_cache_account().stale_kv_tokens == 0
        assert (engine.version, engine.adapter_version("a"), engine.adapter_version("b")) == (0, 2, 1)
    finally:
        await engine.close()


async def test_a_declared_adapter_is_the_base_weights_at_version_0_until_its_first_load(tiny_model_path: Path) -> None:
    engine = _engine(tiny_model_path, adapters=("a",))
    try:
        base = await _one(engine, "base", None)
        fresh = await _one(engine, "fresh", "a")
        assert (fresh.output_ids, fresh.log_probs, set(fresh.versions)) == (base.output_ids, base.log_probs, {0})
        with pytest.raises(ValueError, match=r"request 'c': adapter 'c' is not loaded on this engine"):
            await _one(engine, "c", "c")
        await engine.update_weights(random_adapter(engine.model, 4, 1, scale=0.5), 1, adapter="a")
        trained = await _one(engine, "trained", "a")
        assert trained.output_ids != base.output_ids and set(trained.versions) == {1}
    finally:
        await engine.close()
    with pytest.raises(ValueError, match=r"3 adapters \(a, b, c\) exceed max_adapters=2"):
        _engine(tiny_model_path, adapters=("a", "b", "c"), max_adapters=2)
    with pytest.raises(ValueError, match="adapters must be distinct non-empty names"):
        _engine(tiny_model_path, adapters=("a", "a"))


async def test_no_adapter_row_takes_keys_and_values_the_base_or_another_adapter_computed(
        tiny_model_path: Path) -> None:
    """The prefix cache holds rows of the base weights only: a row of an adapter neither reads it nor writes it, so
    no policy (nor one of its versions) attends to keys and values another computed; an adapter's load leaves the
    base weights' entries usable."""
    alone: dict[str, list[int]] = {}
    for name, seed in (("a", 1), ("b", 2)):
        uncached = _engine(tiny_model_path, prefix_cache_bytes=0)
        try:
            await uncached.update_weights(random_adapter(uncached.model, 4, seed, scale=0.5), 1, adapter=name)
            alone[name] = (await _one(uncached, name, name)).output_ids
        finally:
            await uncached.close()
    engine = _engine(tiny_model_path)
    try:
        await engine.update_weights(random_adapter(engine.model, 4, 1, scale=0.5), 1, adapter="a")
        await _one(engine, "base-0", None)
        a = await _one(engine, "a-1", "a")
        await engine.update_weights(random_adapter(engine.model, 4, 2, scale=0.5), 1, adapter="b")
        b = await _one(engine, "b-1", "b")
        again = await _one(engine, "a-2", "a")
        assert (a.cached_tokens, b.cached_tokens, again.cached_tokens) == (0, 0, 0)
        assert (a.output_ids, b.output_ids, again.output_ids) == (alone["a"], alone["b"], alone["a"])
        base = await _one(engine, "base-1", None)
        assert base.cached_tokens == len(PROMPT) - 1  # the base's own entry, still usable after two adapter loads
    finally:
        await engine.close()


async def test_a_run_of_several_policies_starts_its_engines_serving_each_policys_fresh_adapter(
        tiny_model_path: Path) -> None:
    from actors.config import RunConfig
    from actors.rollout.engine_factory import load_engine

    config = RunConfig(hf_checkpoint=str(tiny_model_path), lora_rank=4, policies={"solver": {}, "proposer": {}})
    engine, _ = await asyncio.to_thread(load_engine, config, "rollout-0-0")
    try:
        outputs = {policy: await _one(engine, policy, policy) for policy in ("solver", "proposer")}  # type: ignore[arg-type]
        assert {policy: set(output.versions) for policy, output in outputs.items()} == {"solver": {0}, "proposer": {0}}
    finally:
        await engine.close()
