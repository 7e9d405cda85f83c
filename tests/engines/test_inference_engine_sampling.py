"""Sampling parameters through the whole engine: stops, budgets, n samples and seeds."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engines.inference import GenerateRequest, SamplingParams, TorchEngine

PROMPT_TEXT = "Once upon a time"


@pytest.fixture
async def engine(tiny_model_path: Path) -> TorchEngine:
    async with TorchEngine.from_pretrained(tiny_model_path, seed=0) as engine:
        yield engine


async def _one(engine: TorchEngine, params: SamplingParams, request_id: str = "r") -> object:
    [output] = await engine.generate(GenerateRequest(request_id, engine.tokenizer.encode(PROMPT_TEXT), params))
    return output


async def _greedy_reference(engine: TorchEngine, tokens: int = 30) -> list[int]:
    output = await _one(engine, SamplingParams(temperature=0, max_new_tokens=tokens, ignore_eos=True), "ref")
    return output.output_ids


def _first_new_token_index(tokens: list[int], start: int) -> int:
    """The first index >= start whose token did not occur before it, so a stop on it triggers there first."""
    return next(index for index in range(start, len(tokens)) if tokens[index] not in tokens[:index])


@pytest.mark.integration
async def test_stop_string_ends_the_sample_on_the_token_that_completes_it(engine: TorchEngine) -> None:
    reference = await _greedy_reference(engine)
    text = [engine.tokenizer.decode([token]) for token in reference]  # one character per token
    stop = text[6] + text[7]
    end = next(index for index in range(1, len(text)) if stop in "".join(text[: index + 1]))
    output = await _one(engine, SamplingParams(temperature=0, max_new_tokens=30, stop=(stop,), ignore_eos=True))
    assert (output.finish_reason, output.matched_stop) == ("stop", stop)
    assert output.output_ids == reference[: end + 1]


@pytest.mark.integration
async def test_stop_token_id_ends_the_sample_and_is_kept_in_the_output(engine: TorchEngine) -> None:
    reference = await _greedy_reference(engine)
    index = _first_new_token_index(reference, 5)
    params = SamplingParams(temperature=0, max_new_tokens=30, stop_token_ids=(reference[index],), ignore_eos=True)
    output = await _one(engine, params)
    assert (output.finish_reason, output.matched_stop) == ("stop", reference[index])
    assert output.output_ids == reference[: index + 1]
    assert len(output.log_probs) == len(output.versions) == index + 1


@pytest.mark.integration
async def test_model_eos_stops_a_sample_unless_ignore_eos(tiny_model_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    async with TorchEngine(model, tokenizer) as probe:
        reference = await _greedy_reference(probe)
    index = _first_new_token_index(reference, 4)
    model.generation_config.eos_token_id = [reference[index], 2]  # what a chat model's EOS list looks like
    async with TorchEngine(model, tokenizer) as engine:
        stopped = await _one(engine, SamplingParams(temperature=0, max_new_tokens=30))
        ignored = await _one(engine, SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True))
    assert (stopped.finish_reason, stopped.output_ids) == ("stop", reference[: index + 1])
    assert (ignored.finish_reason, ignored.output_ids) == ("length", reference)


@pytest.mark.integration
async def test_max_new_tokens_ends_the_sample_with_reason_length(engine: TorchEngine) -> None:
    output = await _one(engine, SamplingParams(max_new_tokens=7, ignore_eos=True))
    assert (output.finish_reason, len(output.output_ids), output.matched_stop) == ("length", 7, None)
    assert output.prompt_len == len(engine.tokenizer.encode(PROMPT_TEXT))


@pytest.mark.integration
async def test_n_samples_come_back_ordered_and_differ(engine: TorchEngine) -> None:
    prompt = engine.tokenizer.encode(PROMPT_TEXT)
    outputs = await engine.generate(
        GenerateRequest("r", prompt, SamplingParams(n=4, max_new_tokens=20, ignore_eos=True))
    )
    assert [output.sample_index for output in outputs] == [0, 1, 2, 3]
    assert all(output.request_id == "r" and len(output.output_ids) == 20 for output in outputs)
    assert len({tuple(output.output_ids) for output in outputs}) == 4


@pytest.mark.integration
async def test_seeded_request_repeats_exactly_whatever_else_is_in_the_batch(engine: TorchEngine) -> None:
    params = SamplingParams(n=2, max_new_tokens=20, seed=1234, ignore_eos=True)
    prompt = engine.tokenizer.encode(PROMPT_TEXT)
    alone = await engine.generate(GenerateRequest("alone", prompt, params))
    crowd = [
        GenerateRequest(f"noise{i}", engine.tokenizer.encode(f"noise {i}!"), SamplingParams(max_new_tokens=9 + i))
        for i in range(5)
    ]
    crowded, *_ = await asyncio.gather(
        engine.generate(GenerateRequest("crowded", prompt, params)), *map(engine.generate, crowd)
    )
    assert [output.output_ids for output in alone] == [output.output_ids for output in crowded]
    torch.testing.assert_close(
        torch.tensor([output.log_probs for output in alone]),
        torch.tensor([output.log_probs for output in crowded]),
        rtol=0,
        atol=1e-5,
    )
    assert alone[0].output_ids != alone[1].output_ids


@pytest.mark.integration
async def test_different_seeds_and_unseeded_requests_give_different_samples(engine: TorchEngine) -> None:
    seeded = [
        await _one(engine, SamplingParams(max_new_tokens=20, seed=seed, ignore_eos=True), f"s{seed}")
        for seed in (1, 2)
    ]
    unseeded = [await _one(engine, SamplingParams(max_new_tokens=20, ignore_eos=True), f"u{i}") for i in range(2)]
    assert seeded[0].output_ids != seeded[1].output_ids
    assert unseeded[0].output_ids != unseeded[1].output_ids


@pytest.mark.integration
async def test_top_k_one_reproduces_greedy_with_log_prob_zero(engine: TorchEngine) -> None:
    reference = await _greedy_reference(engine, tokens=12)
    output = await _one(engine, SamplingParams(temperature=0.8, top_k=1, max_new_tokens=12, ignore_eos=True))
    assert output.output_ids == reference
    assert output.log_probs == [0.0] * 12
