"""The static KV pool's batcher (engine v2) against the dynamic one (v1, the reference) and `generate()`."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from engines.inference import GenerateRequest, SamplingParams, TorchEngine
from engines.inference.sampling import counter_uniforms
from engines.inference.static_batcher import StaticBatcher, bucket
from tests.engines.test_inference_engine_parity import PROMPTS, _hf_greedy_batch
from tests.support.waiting import until
from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model

LENGTHS = [30, 5, 12, 20]


def _requests(engine: TorchEngine, params: SamplingParams, prefix: str = "p") -> list[GenerateRequest]:
    prompts = [engine.tokenizer.encode(text) for text in PROMPTS]
    return [GenerateRequest(f"{prefix}{i}", prompt, SamplingParams(**{**params.__dict__, "max_new_tokens": length}))
            for i, (prompt, length) in enumerate(zip(prompts, LENGTHS, strict=True))]


async def _outputs(engine: TorchEngine, requests: list[GenerateRequest]) -> list[list[list[int]]]:
    results = await asyncio.gather(*(engine.generate(request) for request in requests))
    return [[sample.output_ids for sample in result] for result in results]


@pytest.mark.integration
@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3"])
async def test_greedy_tokens_equal_the_dynamic_batchers_and_generates(tiny_model_cache: Path, family: str) -> None:
    """Two slots and 64 columns for four requests: rows join mid-flight, leave, and the pool compacts."""
    path = cached_tiny_model(tiny_model_cache, TinyModelSpec(family=family))
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    async with TorchEngine.from_pretrained(path, max_batch_size=2) as dynamic:
        expected = await _outputs(dynamic, _requests(dynamic, greedy))
        references = _hf_greedy_batch(dynamic, PROMPTS, max_new_tokens=max(LENGTHS))
    async with TorchEngine.from_pretrained(path, max_batch_size=2, kv_cache="static", kv_pool_columns=64) as static:
        got = await _outputs(static, _requests(static, greedy))
        batcher = static._batcher
    assert isinstance(batcher, StaticBatcher)
    assert batcher.shifts["left"] > 0, "the pool never compacted"
    assert got == expected
    # generate() is cut after its first EOS; these rows ignore EOS and run on
    cut = [reference[:length] for reference, length in zip(references, LENGTHS, strict=True)]
    assert [output[0][: len(reference)] for output, reference in zip(got, cut, strict=True)] == cut


@pytest.mark.integration
async def test_a_joining_row_longer_than_the_write_column_moves_the_running_rows_right(tiny_model_path: Path) -> None:
    greedy = SamplingParams(temperature=0, ignore_eos=True, max_new_tokens=12)
    async with TorchEngine.from_pretrained(tiny_model_path, kv_cache="static", kv_pool_columns=128) as engine:
        short = GenerateRequest("short", engine.tokenizer.encode("hi"), greedy)
        long = GenerateRequest("long", engine.tokenizer.encode(PROMPTS[2]), greedy)
        running = asyncio.ensure_future(engine.generate(short))
        while engine._batcher.steps < 2:  # the short row is decoding at column 3 when the long one joins
            await asyncio.sleep(0.001)
        together = await asyncio.gather(running, engine.generate(long))
        shifts = dict(engine._batcher.shifts)
        alone = [await engine.generate(GenerateRequest(f"alone-{r.request_id}", r.input_ids, greedy))
                 for r in (short, long)]
    assert shifts["right"] > 0
    assert [result[0].output_ids for result in together] == [result[0].output_ids for result in alone]


@pytest.mark.integration
async def test_seeded_samples_do_not_depend_on_the_rows_beside_them(tiny_model_path: Path) -> None:
    sampled = SamplingParams(temperature=1.0, ignore_eos=True, seed=11, n=3)
    async with TorchEngine.from_pretrained(tiny_model_path, max_batch_size=8, kv_cache="static") as engine:
        crowded = await _outputs(engine, _requests(engine, sampled))
    async with TorchEngine.from_pretrained(tiny_model_path, max_batch_size=1, kv_cache="static") as engine:
        alone = [(await _outputs(engine, [request]))[0] for request in _requests(engine, sampled, "solo")]
    assert crowded == alone
    assert all(len({tuple(sample) for sample in request}) == 3 for request in crowded), "n samples came out alike"


@pytest.mark.integration
async def test_top_k_of_one_samples_the_greedy_tokens(tiny_model_path: Path) -> None:
    """The truncated sampling mode (sort, mask, renormalise) on the pool: one survivor is the argmax, probability 1."""
    async with TorchEngine.from_pretrained(tiny_model_path, kv_cache="static") as engine:
        greedy = await _outputs(engine, _requests(engine, SamplingParams(temperature=0, ignore_eos=True)))
        results = await asyncio.gather(*(engine.generate(request) for request in _requests(
            engine, SamplingParams(temperature=0.8, top_k=1, ignore_eos=True), "k")))
    assert [[sample.output_ids for sample in result] for result in results] == greedy
    assert all(log_prob == pytest.approx(0.0, abs=1e-6) for result in results for log_prob in result[0].log_probs)


@pytest.mark.integration
async def test_weight_updates_mid_generation_reprefill_into_the_pool(tiny_model_path: Path) -> None:
    """The same weights pushed while rows decode: their caches are dropped and rebuilt, the tokens stay the same."""
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    async with TorchEngine.from_pretrained(tiny_model_path, max_batch_size=2, kv_cache="static") as engine:
        expected = await _outputs(engine, _requests(engine, greedy, "first"))
        weights = [(name, tensor.detach().clone()) for name, tensor in engine.model.state_dict().items()]
        pending = asyncio.ensure_future(_outputs(engine, _requests(engine, greedy, "second")))
        for version in (1, 2, 3):
            while engine._batcher.steps < 6 * version:
                await asyncio.sleep(0.001)
            await engine.update_weights(weights, version=version)
        got = await pending
    assert got == expected


@pytest.mark.integration
async def test_a_row_longer_than_the_pool_is_refused_by_name(tiny_model_path: Path) -> None:
    async with TorchEngine.from_pretrained(tiny_model_path, kv_cache="static", kv_pool_columns=32) as engine:
        request = GenerateRequest("too-long", engine.tokenizer.encode(PROMPTS[2]), SamplingParams(max_new_tokens=40))
        with pytest.raises(ValueError, match=r"'too-long'.*static KV pool's 32 columns"):
            await engine.generate(request)


@pytest.mark.integration
async def test_releasing_the_pool_between_turns_allocates_a_new_one(tiny_model_path: Path) -> None:
    greedy = SamplingParams(temperature=0, ignore_eos=True)
    async with TorchEngine.from_pretrained(tiny_model_path, kv_cache="static",
                                           release_memory_when_idle=True) as engine:
        first = await _outputs(engine, _requests(engine, greedy, "a"))
        while engine.memory_releases == 0:
            await asyncio.sleep(0.001)
        assert not engine._batcher.pool.allocated
        second = await _outputs(engine, _requests(engine, greedy, "b"))
    assert first == second


@pytest.mark.integration
async def test_a_colocated_engine_paused_with_rows_kept_releases_nothing_and_finishes_them(
        tiny_model_path: Path) -> None:
    """A weight load pauses the engine keeping its rows: that is not a turn's end, and their KV pool must stay (a
    colocated static engine used to release it under them, and its decode thread died)."""
    params = SamplingParams(temperature=0, max_new_tokens=300, ignore_eos=True)
    async with TorchEngine.from_pretrained(tiny_model_path, kv_cache="static",
                                           release_memory_when_idle=True) as engine:
        alone = await engine.generate(GenerateRequest("alone", [7, 12, 30], params))
        running = asyncio.create_task(engine.generate(GenerateRequest("kept", [7, 12, 30], params)))
        await until(lambda: bool(engine._batcher.running), "the request to be decoding")
        releases = engine.memory_releases
        await engine.pause("keep")
        await engine.health()  # a command the decode thread takes after its turn through the paused loop
        await engine.resume()
        kept = await asyncio.wait_for(running, 60)
        assert engine.memory_releases >= releases  # released after the request, not under it
    assert kept[0].output_ids == alone[0].output_ids


@pytest.mark.unit
def test_counter_uniforms_are_a_function_of_seed_and_position_alone() -> None:
    seeds = torch.tensor([0, 1, 2**62 + 5, 123456789012345])
    positions = torch.tensor([0, 0, 7, 1000])
    draws = counter_uniforms(seeds, positions)
    assert draws.dtype == torch.float64
    assert torch.equal(draws[2:], counter_uniforms(seeds[2:], positions[2:]))  # no dependence on other rows
    assert len(set(draws.tolist())) == 4
    many = counter_uniforms(torch.arange(200_000), torch.full((200_000,), 3))
    assert float(many.min()) >= 0 and float(many.max()) < 1
    histogram = torch.histc(many.float(), bins=10, min=0, max=1)
    assert float((histogram - 20_000).abs().max()) < 600  # ~4 sigma of a uniform's bin count
    along = counter_uniforms(torch.full((200_000,), 9), torch.arange(200_000))
    assert abs(float(torch.corrcoef(torch.stack([along[1:], along[:-1]]))[0, 1])) < 0.01


@pytest.mark.unit
@pytest.mark.parametrize(("value", "granule", "limit", "expected"), [
    (1, 32, 256, 1), (3, 32, 256, 4), (17, 32, 256, 32), (33, 32, 256, 64), (200, 32, 256, 224), (250, 32, 256, 256),
    (257, 256, 2048, 512), (2000, 256, 2048, 2048), (5, 1, 64, 5),
])
def test_buckets_round_up_to_powers_of_two_then_to_granules(value: int, granule: int, limit: int,
                                                            expected: int) -> None:
    assert bucket(value, granule, limit) == expected

