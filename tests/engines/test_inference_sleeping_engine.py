"""The pipeline benchmark's sleeping engine (tools/sim/pipeline.py) honours the InferenceEngine contract the real
engines do: per-token versions as weights land mid-generation, log-probs per token, aborts, pause and resume."""

from __future__ import annotations

import asyncio

import pytest

from engines.inference.base import GenerateOutput, GenerateRequest, SamplingParams
from tools.sim.pipeline import SimSpec, SleepingEngine, SleepingTokenizer


@pytest.mark.unit
def test_sleeping_engine_tags_tokens_with_the_version_in_force_when_each_was_produced() -> None:
    spec = SimSpec(token_seconds=0.01, length_min=20, length_max=20)
    engine = SleepingEngine(spec, seed=[0])
    request = GenerateRequest("r", [1, 2, 3], SamplingParams(n=2, max_new_tokens=20))

    async def generate_with_an_update_midway() -> list[GenerateOutput]:
        generating = asyncio.ensure_future(engine.generate(request))
        await asyncio.sleep(0.1)
        await engine.update_weights([], 3)
        return await generating

    outputs = asyncio.run(generate_with_an_update_midway())
    for output in outputs:
        assert len(output.output_ids) == len(output.log_probs) == len(output.versions) == 20
        assert output.versions[0] == 0 and output.versions[-1] == 3 and output.versions == sorted(output.versions)
        assert output.finish_reason == "length"  # max_new_tokens reached: a truncated sample


@pytest.mark.unit
def test_aborting_a_sleeping_request_returns_the_tokens_paid_for() -> None:
    engine = SleepingEngine(SimSpec(token_seconds=0.01, length_min=100, length_max=100), seed=[0])

    async def abort_after_a_while() -> list[GenerateOutput]:
        request = GenerateRequest("r", [1], SamplingParams(max_new_tokens=100))
        generating = asyncio.ensure_future(engine.generate(request))
        await asyncio.sleep(0.2)
        await engine.abort("r")
        return await generating

    (output,) = asyncio.run(abort_after_a_while())
    assert output.finish_reason == "abort" and 5 <= len(output.output_ids) < 100


@pytest.mark.unit
def test_a_paused_sleeping_engine_holds_new_requests_until_resumed() -> None:
    engine = SleepingEngine(SimSpec(token_seconds=0.0), seed=[0])

    async def pause_then_resume() -> tuple[bool, list[GenerateOutput]]:
        await engine.pause("keep")
        generating = asyncio.ensure_future(engine.generate(GenerateRequest("r", [1])))
        await asyncio.sleep(0.1)
        held = not generating.done()
        await engine.resume()
        return held, await generating

    held, outputs = asyncio.run(pause_then_resume())
    assert held and len(outputs) == 1


@pytest.mark.unit
def test_sleeping_engine_answers_the_benchmark_prompts_right_as_often_as_the_spec_says() -> None:
    engine, tokenizer = SleepingEngine(SimSpec(correct_fraction=1.0, token_seconds=0.0), seed=[0]), SleepingTokenizer()
    prompt = tokenizer("What is 12 + 30? Put the answer in \\boxed{}.")["input_ids"]
    (output,) = asyncio.run(engine.generate(GenerateRequest("r", prompt, SamplingParams(max_new_tokens=1024))))
    assert tokenizer.decode(output.output_ids).endswith("\\boxed{42}")
