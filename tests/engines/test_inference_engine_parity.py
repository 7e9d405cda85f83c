"""The torch engine is the reference: greedy output equals `generate()`, log-probs equal the trainer's."""

from __future__ import annotations

import asyncio
import warnings
from pathlib import Path

import pytest
import torch

from engines.inference import GenerateRequest, SamplingParams, StepRecord, TorchEngine
from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model

PROMPTS = ["hi", "What is 12 * 7?", "Write a haiku about the sea, please.", "abc def"]


async def _generate_all(engine: TorchEngine, prompts: list[list[int]], params: SamplingParams) -> list:
    requests = [GenerateRequest(f"p{i}", prompt, params) for i, prompt in enumerate(prompts)]
    return await asyncio.gather(*(engine.generate(request) for request in requests))


def _hf_greedy_batch(engine: TorchEngine, texts: list[str], max_new_tokens: int) -> list[list[int]]:
    """transformers `generate()` on the same left-padded batch, cut after the first EOS like the engine."""
    tokenizer = engine.tokenizer
    tokenizer.padding_side = "left"
    encoded = tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        generated = engine.model.generate(**encoded, max_new_tokens=max_new_tokens, do_sample=False)
    eos = engine.model.generation_config.eos_token_id
    references = []
    for row in generated[:, encoded["input_ids"].shape[1] :].tolist():
        references.append(row[: row.index(eos) + 1] if eos in row else row)
    return references


@pytest.mark.integration
@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3", "qwen3_moe", "mixtral"])
async def test_greedy_batch_equals_transformers_generate(tiny_model_cache: Path, family: str) -> None:
    path = cached_tiny_model(tiny_model_cache, TinyModelSpec(family=family))
    async with TorchEngine.from_pretrained(path) as engine:
        prompts = [engine.tokenizer.encode(text) for text in PROMPTS]
        outputs = await _generate_all(engine, prompts, SamplingParams(temperature=0, max_new_tokens=24))
        references = _hf_greedy_batch(engine, PROMPTS, max_new_tokens=24)
    assert [output[0].output_ids for output in outputs] == references


@pytest.mark.integration
@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3", "qwen3_moe", "mixtral"])
async def test_generation_emits_no_deprecation_warning(tiny_model_cache: Path, family: str) -> None:
    """Every actor's console would repeat what transformers deprecates in the engine's forward (the decode thread
    shares the process's warning filters, so recording here sees its warnings too)."""
    path = cached_tiny_model(tiny_model_cache, TinyModelSpec(family=family))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        async with TorchEngine.from_pretrained(path) as engine:
            params = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
            await _generate_all(engine, [engine.tokenizer.encode(text) for text in PROMPTS[:2]], params)
    deprecations = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught
                    if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    assert deprecations == []


@pytest.mark.integration
async def test_greedy_output_is_unchanged_when_requests_join_mid_flight(tiny_model_path: Path) -> None:
    records: list[StepRecord] = []
    async with TorchEngine.from_pretrained(tiny_model_path, max_batch_size=2, step_listener=records.append) as engine:
        prompts = [engine.tokenizer.encode(text) for text in PROMPTS]
        lengths = [30, 5, 12, 20]
        requests = [
            GenerateRequest(f"p{i}", prompt, SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True))
            for i, (prompt, n) in enumerate(zip(prompts, lengths, strict=True))
        ]
        outputs = await asyncio.gather(*(engine.generate(request) for request in requests))
        alone = [
            await engine.generate(GenerateRequest(f"solo{i}", r.input_ids, r.params)) for i, r in enumerate(requests)
        ]
    assert any(record.admitted and record.decoded for record in records), "no request joined a running batch"
    assert [output[0].output_ids for output in outputs] == [output[0].output_ids for output in alone]


@pytest.mark.integration
@pytest.mark.parametrize("temperature", [0.7, 0.0])
async def test_log_probs_equal_the_trainers_full_sequence_log_softmax(
    tiny_model_path: Path, temperature: float
) -> None:
    async with TorchEngine.from_pretrained(tiny_model_path, max_batch_size=3) as engine:
        prompts = [engine.tokenizer.encode(text) for text in PROMPTS]
        params = SamplingParams(temperature=temperature, max_new_tokens=16, n=2, ignore_eos=True)
        outputs = [sample for group in await _generate_all(engine, prompts, params) for sample in group]
        model = engine.model
    scale = temperature or 1.0  # greedy reports log_softmax(logits), i.e. temperature 1
    for output in outputs:
        prompt = prompts[int(output.request_id[1:])]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + output.output_ids])).logits[0].float()
        trainer = torch.log_softmax(logits / scale, dim=-1)[len(prompt) - 1 : -1]
        expected = trainer.gather(-1, torch.tensor(output.output_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(output.log_probs), expected, rtol=0, atol=1e-5)


@pytest.mark.integration
async def test_waiting_request_joins_before_the_longest_running_one_finishes(tiny_model_path: Path) -> None:
    records: list[StepRecord] = []
    async with TorchEngine.from_pretrained(tiny_model_path, max_batch_size=2, step_listener=records.append) as engine:
        prompt = engine.tokenizer.encode("tell me a story")

        def request(request_id: str, tokens: int) -> GenerateRequest:
            return GenerateRequest(request_id, prompt, SamplingParams(max_new_tokens=tokens, ignore_eos=True))

        finished_order: list[str] = []

        async def run(req: GenerateRequest) -> None:
            await engine.generate(req)
            finished_order.append(req.request_id)

        await asyncio.gather(run(request("long", 60)), run(request("short", 4)), run(request("waiting", 4)))
    joined = next(record for record in records if ("waiting", 0) in record.admitted)
    assert ("long", 0) in joined.decoded, "the waiting request only started after the long one"
    assert finished_order.index("waiting") < finished_order.index("long")
    assert max(record.rows for record in records) <= 2
