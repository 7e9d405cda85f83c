"""Chunked prefill in the torch engine: a prefill longer than `prefill_chunk_tokens` runs as forwards of at most that
many tokens, one per step between the running rows' decode steps, and samples what the one-forward prefill samples.

Tolerance: greedy tokens must be equal; log-probs to 1e-5 absolute (fp32). A chunk's attention reduces over another
split of the same keys than the whole forward's does (and the stock kernels pick their blocking by shape), so the
logits differ by float rounding (at most 4.8e-7 in these tests' log-probs); 1e-5 is what the engine's other exactness
tests allow for reductions that differ only in order. Batch-invariant decoding is compared bit for bit."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engines.inference import GenerateOutput, GenerateRequest, SamplingParams, TorchEngine
from engines.inference.batcher import BatchLimits, ContinuousBatcher, StepRecord
from engines.inference.decoding_sequence import DecodingSequence
from engines.inference.kv_batch import ChunkedPrefill, KVBatch
from tests.engines.test_engine_routes import routes_of
from tests.support.adapters import random_adapter
from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model

GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True, seed=3)
UNCHUNKED = 1 << 20
# Three rows of different lengths in one prefill: with a chunk of 7 tokens each forward runs 2 columns of all three.
PROMPTS = [[(7 * index + 3) % 90 + 5 for index in range(41)], [(5 * index + 1) % 80 + 9 for index in range(23)],
           [11, 12, 13, 14, 15, 16, 17, 18, 19]]


def _model(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


async def _generate(engine: TorchEngine, prompts: list[list[int]], params: SamplingParams, tag: str = "r",
                    adapters: list[str | None] | None = None) -> list[GenerateOutput]:
    """All `prompts` submitted while the engine is paused, so they are admitted (and prefilled) together."""
    adapters = adapters or [None] * len(prompts)
    await engine.pause()
    tasks = [asyncio.create_task(engine.generate(GenerateRequest(f"{tag}{index}", prompt, params, adapter=adapter)))
             for index, (prompt, adapter) in enumerate(zip(prompts, adapters, strict=True))]
    while (await engine.health())["requests"] < len(prompts):
        await asyncio.sleep(0.01)
    await engine.resume()
    return [output for outputs in await asyncio.gather(*tasks) for output in outputs]


def _assert_same(got: list[GenerateOutput], expected: list[GenerateOutput]) -> None:
    assert [output.output_ids for output in got] == [output.output_ids for output in expected]
    for output, reference in zip(got, expected, strict=True):
        torch.testing.assert_close(torch.tensor(output.log_probs), torch.tensor(reference.log_probs), rtol=0,
                                   atol=1e-5)


def _forward_sizes(model: torch.nn.Module) -> tuple[list[int], torch.utils.hooks.RemovableHandle]:
    """The input tokens (rows x columns) of every forward of `model` from now on."""
    sizes: list[int] = []

    def record(_module: torch.nn.Module, _args: tuple, kwargs: dict) -> None:
        sizes.append(kwargs["input_ids"].numel())

    return sizes, model.register_forward_pre_hook(record, with_kwargs=True)


@pytest.mark.unit
@pytest.mark.parametrize("chunk", [1, 5, 16])
@pytest.mark.parametrize("share_prefix", [False, True])
def test_a_chunked_prefill_computes_the_one_forward_prefills_logits_and_cache(tiny_model_path: Path, chunk: int,
                                                                              share_prefix: bool) -> None:
    model = _model(tiny_model_path)
    sequences = [[*PROMPTS[1][:12], *PROMPTS[0][:20]], [*PROMPTS[1][:12], 60, 61], PROMPTS[1][:12] + PROMPTS[2]]
    with torch.inference_mode():
        whole, whole_logits = KVBatch.prefill(model, sequences, 0, share_prefix=share_prefix)
        sizes, hook = _forward_sizes(model)
        run = ChunkedPrefill(model, sequences, 0, share_prefix=share_prefix, chunk_tokens=chunk)
        planned = run.forwards_left
        while not run.done:
            run.advance()
        hook.remove()
        chunked, chunked_logits = run.result()
        assert len(sizes) == planned > 1
        assert max(sizes) <= max(chunk, len(sequences))  # never narrower than one column of every row
        torch.testing.assert_close(chunked_logits, whole_logits, rtol=0, atol=1e-5)
        torch.testing.assert_close(chunked.attention_mask, whole.attention_mask, rtol=0, atol=0)
        for mine, theirs in zip(chunked._layers(), whole._layers(), strict=True):
            torch.testing.assert_close(mine.keys, theirs.keys, rtol=0, atol=1e-5)
            torch.testing.assert_close(mine.values, theirs.values, rtol=0, atol=1e-5)
        next_tokens = torch.tensor([3, 4, 5])
        torch.testing.assert_close(chunked.decode(model, next_tokens), whole.decode(model, next_tokens), rtol=0,
                                   atol=1e-5)


@pytest.mark.integration
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("chunk", [1, 7, 30])
async def test_rows_of_different_lengths_sample_what_the_unchunked_engine_samples(tiny_model_path: Path,
                                                                                  params: SamplingParams,
                                                                                  chunk: int) -> None:
    async with TorchEngine(_model(tiny_model_path), None, seed=0, prefill_chunk_tokens=UNCHUNKED,
                           prefix_cache_bytes=0) as whole:
        expected = await _generate(whole, PROMPTS, params)
    steps: list[StepRecord] = []
    async with TorchEngine(_model(tiny_model_path), None, seed=0, prefill_chunk_tokens=chunk, prefix_cache_bytes=0,
                           step_listener=steps.append) as chunked:
        got = await _generate(chunked, PROMPTS, params)
    assert any(record.prefilling for record in steps)  # the prefill did run over several steps
    _assert_same(got, expected)


@pytest.mark.integration
async def test_a_cached_past_plus_chunks_samples_what_the_unchunked_engine_samples(tiny_model_path: Path) -> None:
    """The second turn of each conversation takes the first turn from the prefix cache and prefills the rest in
    chunks; two of the conversations share their first prompt."""
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0]]
    replies = [[30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42], [50, 51, 52], [60, 61, 62, 63, 64, 65]]
    results = {}
    for chunk in (UNCHUNKED, 4):
        async with TorchEngine(_model(tiny_model_path), None, seed=0, prefill_chunk_tokens=chunk) as engine:
            first = await _generate(engine, prompts, GREEDY, "t0-")
            history = [prompt + output.output_ids + reply
                       for prompt, output, reply in zip(prompts, first, replies, strict=True)]
            results[chunk] = (first, await _generate(engine, history, GREEDY, "t1-"))
    (first_whole, second_whole), (first_chunked, second_chunked) = results[UNCHUNKED], results[4]
    assert all(output.cached_tokens > 0 for output in second_chunked)  # the past came from the cache
    _assert_same(first_chunked, first_whole)
    _assert_same(second_chunked, second_whole)


@pytest.mark.integration
async def test_rows_with_named_adapters_sample_what_the_unchunked_engine_samples(tiny_model_path: Path) -> None:
    adapters = ["a", None, "b"]
    results = {}
    for chunk in (UNCHUNKED, 6):
        async with TorchEngine(_model(tiny_model_path), None, seed=0, prefill_chunk_tokens=chunk,
                               lora_scaling=2.0) as engine:
            for name, seed in (("a", 1), ("b", 2)):
                await engine.update_weights(random_adapter(engine.model, 4, seed, scale=0.5), 1, adapter=name)
            results[chunk] = await _generate(engine, PROMPTS, GREEDY, adapters=adapters)
    _assert_same(results[6], results[UNCHUNKED])
    async with TorchEngine(_model(tiny_model_path), None, seed=0, lora_scaling=2.0) as base:
        plain = await _generate(base, PROMPTS, GREEDY)
    assert results[6][0].output_ids != plain[0].output_ids  # the adapter row did run with its adapter


@pytest.mark.integration
async def test_recorded_routes_of_a_chunked_prefill_are_the_unchunked_ones(tiny_model_cache: Path) -> None:
    path = cached_tiny_model(tiny_model_cache, TinyModelSpec(family="qwen3_moe", experts=8))
    results = {}
    for chunk in (UNCHUNKED, 5):
        async with TorchEngine(_model(path), None, seed=0, prefill_chunk_tokens=chunk, record_routes=True) as engine:
            results[chunk] = await _generate(engine, PROMPTS, GREEDY)
    _assert_same(results[5], results[UNCHUNKED])
    for prompt, mine, theirs in zip(PROMPTS, results[5], results[UNCHUNKED], strict=True):
        assert routes_of(mine).shape[0] == len(prompt) + len(mine.output_ids) - 1
        assert torch.equal(routes_of(mine), routes_of(theirs))


@pytest.mark.integration
async def test_the_static_pool_takes_a_chunked_prefill_and_decodes_the_same_tokens(tiny_model_path: Path) -> None:
    results = {}
    for chunk in (UNCHUNKED, 7):
        async with TorchEngine(_model(tiny_model_path), None, seed=0, prefill_chunk_tokens=chunk, kv_cache="static",
                               kv_pool_columns=64, max_batch_size=4) as engine:
            results[chunk] = await _generate(engine, PROMPTS, GREEDY)
    async with TorchEngine(_model(tiny_model_path), None, seed=0) as dynamic:
        reference = await _generate(dynamic, PROMPTS, GREEDY)
    _assert_same(results[7], results[UNCHUNKED])
    assert [output.output_ids for output in results[7]] == [output.output_ids for output in reference]


@pytest.mark.integration
async def test_batch_invariant_decoding_of_a_chunked_prefill_is_bit_for_bit_the_unchunked_one(
        tiny_model_path: Path) -> None:
    """Batch-invariant attention sums over the keys in a fixed order whatever their number, so there the chunks
    change no bit."""
    results = {}
    for chunk in (UNCHUNKED, 8):
        async with TorchEngine(_model(tiny_model_path), None, seed=0, prefill_chunk_tokens=chunk,
                               deterministic=True, prefix_cache_bytes=0) as engine:
            results[chunk] = await _generate(engine, PROMPTS, SEEDED)
    assert [output.output_ids for output in results[8]] == [output.output_ids for output in results[UNCHUNKED]]
    assert [output.log_probs for output in results[8]] == [output.log_probs for output in results[UNCHUNKED]]


def _sample(request_id: str, prompt: list[int], max_new_tokens: int) -> DecodingSequence:
    return DecodingSequence(request_id, 0, prompt, GREEDY, max_new_tokens, frozenset())


@pytest.mark.integration
def test_running_rows_decode_a_token_every_step_while_a_long_prompt_prefills(tiny_model_path: Path) -> None:
    model = _model(tiny_model_path)
    batcher = ContinuousBatcher(model, None, BatchLimits(prefill_chunk_tokens=8), torch.Generator().manual_seed(0))
    running, long = _sample("running", [5, 6, 7], 20), _sample("long", PROMPTS[0], 2)
    records = []
    with torch.inference_mode():
        batcher.add([running])
        records.append(batcher.step(0).record)
        batcher.add([long])
        sizes, hook = _forward_sizes(model)
        while long.finish_reason is None:
            records.append(batcher.step(0).record)
        hook.remove()
    chunks = -(-len(PROMPTS[0]) // 8)
    prefilling = [record for record in records if record.prefilling == (("long", 0),)]
    assert len(prefilling) == chunks - 1  # its last chunk's step joins it
    assert all(record.decoded == (("running", 0),) for record in prefilling)  # the running row never stalled
    assert records[len(prefilling) + 1].admitted == (("long", 0),)
    assert max(sizes) <= 8
    assert len(running.output_ids) == len(records)


@pytest.mark.integration
@pytest.mark.parametrize("interruption", ["drop_cache", "abort_other", "abort_it"])
def test_a_prefill_interrupted_between_chunks_starts_over_and_samples_the_same(tiny_model_path: Path,
                                                                              interruption: str) -> None:
    """New weights (`drop_cache`), or an abort of one of its samples, stop a prefill in progress: the samples that
    remain start it over, and sample what an uninterrupted prefill samples. What new weights threw away is counted as
    prefilled again: the first forward's 8 columns of both rows, the shorter row's all padding."""
    model = _model(tiny_model_path)

    def run(interrupt: bool) -> DecodingSequence:
        batcher = ContinuousBatcher(model, None, BatchLimits(prefill_chunk_tokens=16), torch.Generator())
        kept, other = _sample("kept", PROMPTS[0], 4), _sample("other", PROMPTS[1], 4)
        with torch.inference_mode():
            batcher.add([kept, other])
            batcher.step(0)
            assert batcher.prefilling is not None and batcher.prefilling.samples == [kept, other]
            if interrupt:
                assert batcher.prefilling.computed_tokens == 8
                if interruption == "drop_cache":
                    batcher.drop_cache()
                else:
                    aborted = batcher.abort({"other" if interruption == "abort_other" else "kept"})
                    assert [sample.finish_reason for sample in aborted] == ["abort"]
                assert batcher.prefilling is None
                assert batcher.reprefilled_tokens == (8 if interruption == "drop_cache" else 0)
            while batcher.has_work():
                batcher.step(0)
        return other if interruption == "abort_it" else kept

    interrupted, whole = run(True), run(False)
    assert interrupted.output_ids == whole.output_ids
    torch.testing.assert_close(torch.tensor(interrupted.log_probs), torch.tensor(whole.log_probs), rtol=0, atol=1e-5)


@pytest.mark.unit
def test_a_chunk_size_below_one_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="prefill_chunk_tokens must be an int >= 1, got 0"):
        BatchLimits(prefill_chunk_tokens=0)
