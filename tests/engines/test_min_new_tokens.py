"""A minimum response length (`SamplingParams.min_new_tokens`, slime's --eval-min-new-tokens) on the torch engine
and on the SGLang wire: stop and end-of-sequence ids are held back until the sample has that many tokens."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from engines.inference import GenerateRequest, SamplingParams, TorchEngine
from engines.sglang.protocol import sampling_params_json
from tools.standins.sglang_server.parsing import parse_sampling_params

PROMPT = "Once upon a time"


async def _greedy(engine: TorchEngine, params: SamplingParams) -> object:
    [output] = await engine.generate(GenerateRequest("r", engine.tokenizer.encode(PROMPT), params))
    return output


@pytest.mark.integration
async def test_stop_ids_are_held_back_until_the_minimum_then_end_the_sample(tiny_model_path: Path) -> None:
    """The greedy sample's first token made a stop id: without a minimum it ends the sample at once; with
    min_new_tokens 4 it cannot be drawn for the first 4 tokens (the greedy pick becomes another token), and the
    sample ends on it, or on the length, only after them."""
    async with TorchEngine.from_pretrained(tiny_model_path, seed=0) as engine:
        first = (await _greedy(engine, SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True))).output_ids[0]
        stops_at_once = SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(first,), ignore_eos=True)
        assert (await _greedy(engine, stops_at_once)).output_ids == [first]
        held = SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(first,), ignore_eos=True,
                              min_new_tokens=4)
        output = await _greedy(engine, held)
    assert first not in output.output_ids[:4] and len(output.output_ids) >= 4
    assert output.finish_reason == "length" or output.output_ids.index(first) >= 4
    assert all(math.isfinite(log_prob) for log_prob in output.log_probs)


@pytest.mark.integration
async def test_the_static_kv_cache_refuses_a_minimum_length_by_name(tiny_model_path: Path) -> None:
    async with TorchEngine.from_pretrained(tiny_model_path, seed=0, kv_cache="static") as engine:
        with pytest.raises(ValueError, match="min_new_tokens needs kv_cache='dynamic'"):
            await _greedy(engine, SamplingParams(temperature=0, max_new_tokens=8, min_new_tokens=2))


@pytest.mark.unit
def test_min_new_tokens_travels_to_sglang_and_back_and_is_checked() -> None:
    params = SamplingParams(temperature=0, max_new_tokens=8, min_new_tokens=3)
    wire = sampling_params_json(params, seed=None)
    assert wire["min_new_tokens"] == 3
    assert "min_new_tokens" not in sampling_params_json(SamplingParams(max_new_tokens=8), seed=None)
    assert parse_sampling_params(wire, where="item 0").min_new_tokens == 3
    with pytest.raises(ValueError, match=r"min_new_tokens must be an int in \[0, max_new_tokens=8\], got 9"):
        SamplingParams(max_new_tokens=8, min_new_tokens=9)
