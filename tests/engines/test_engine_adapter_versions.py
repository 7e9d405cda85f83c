"""Each named adapter of a torch engine has its own policy version: its rows' tokens carry it, an update of it lands in
its rows only, and the prefix cache keeps each policy's keys and values for its own rows."""

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


async def _alone(path: Path, adapter: str, seeds: list[int]) -> list[int]:
    """What `adapter` decodes from PROMPT on an engine without a prefix cache, after loads of `seeds`' factors."""
    engine = _engine(path, prefix_cache_bytes=0)
    try:
        for version, seed in enumerate(seeds, start=1):
            await engine.update_weights(random_adapter(engine.model, 4, seed, scale=0.5), version, adapter=adapter)
        return (await _one(engine, adapter, adapter)).output_ids
    finally:
        await engine.close()


async def test_each_adapter_reuses_its_own_cached_prefixes_and_no_other_policys(tiny_model_path: Path) -> None:
    """The prefix cache keeps each adapter's keys and values apart: a row of an adapter takes what that adapter's
    rows computed at its current weights, never the base weights' nor another adapter's entries for the same tokens,
    and a load of one adapter voids its own entries only. Every output is what the adapter decodes with no cache."""
    cached = len(PROMPT) - 1  # the last prompt token is always computed: its logits give the first token
    alone = {"a": await _alone(tiny_model_path, "a", [1]), "b": await _alone(tiny_model_path, "b", [2]),
             "a2": await _alone(tiny_model_path, "a", [1, 3])}
    engine = _engine(tiny_model_path)
    try:
        await engine.update_weights(random_adapter(engine.model, 4, 1, scale=0.5), 1, adapter="a")
        await engine.update_weights(random_adapter(engine.model, 4, 2, scale=0.5), 1, adapter="b")
        await _one(engine, "base-0", None)
        a = await _one(engine, "a-1", "a")
        b = await _one(engine, "b-1", "b")
        assert (a.cached_tokens, b.cached_tokens) == (0, 0)  # the base's entry and a's hold the same tokens
        assert engine.cached_prefix_tokens(PROMPT, "a") == engine.cached_prefix_tokens(PROMPT, "b") == len(PROMPT)
        again = await _one(engine, "a-2", "a")
        assert again.cached_tokens == cached
        assert (a.output_ids, b.output_ids, again.output_ids) == (alone["a"], alone["b"], alone["a"])

        await engine.update_weights(random_adapter(engine.model, 4, 3, scale=0.5), 2, adapter="a")
        assert engine.cached_prefix_tokens(PROMPT, "a") == 0
        a2 = await _one(engine, "a-3", "a")
        assert (a2.cached_tokens, a2.stale_cached_tokens, a2.output_ids) == (0, cached, alone["a2"])
        b2 = await _one(engine, "b-2", "b")
        base = await _one(engine, "base-1", None)
        assert (b2.cached_tokens, base.cached_tokens) == (cached, cached)  # a's load left theirs usable
        assert b2.output_ids == alone["b"]
        assert engine.kv_cache_account().stale_kv_tokens == 0

        stats = engine.prefix_cache_stats()
        assert stats is not None
        await engine.unload_adapter("b")
        after = engine.prefix_cache_stats()
        assert after is not None and after.held_tokens < stats.held_tokens
        assert engine.cached_prefix_tokens(PROMPT, "b") == 0
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
