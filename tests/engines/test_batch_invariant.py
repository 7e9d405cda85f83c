"""Batch-invariant inference: a sequence's logits and log-probs are the same bits whatever is decoded beside it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engines.inference import GenerateRequest, SamplingParams, TorchEngine
from engines.inference.batch_invariant import pairwise_sum, sample_padded_rows
from engines.inference.sampling import RowParams
from tests.support.batch_invariance import check_decoding_is_batch_invariant, sample_prompts


@pytest.mark.unit
@pytest.mark.parametrize("length", [1, 2, 3, 5, 8, 13, 31, 32, 33, 100])
def test_pairwise_sum_ignores_leading_zero_padding_and_sums(length: int) -> None:
    values = torch.randn(3, length, generator=torch.Generator().manual_seed(length)) * 1e3
    alone = pairwise_sum(values, dim=-1)
    for padding in (1, 7, 64, 300):
        padded = torch.cat([torch.zeros(3, padding), values], dim=-1)
        assert torch.equal(pairwise_sum(padded, dim=-1), alone)
    torch.testing.assert_close(alone, values.double().sum(-1).float(), rtol=1e-5, atol=1e-2)


@pytest.mark.unit
@pytest.mark.parametrize("truncation", [(1.0, 0), (0.9, 0), (1.0, 20)], ids=["full", "top-p", "top-k"])
def test_sampling_gives_each_row_the_same_log_prob_alone_and_among_rows(truncation: tuple[float, int]) -> None:
    """Top-k renormalizes with a logsumexp over a row of mostly -inf; for a lone row that kernel rounded otherwise
    (stock sampling failed this for 2 of 8 rows, over Qwen's 152k vocabulary and over SmolLM2's 49k alike)."""
    top_p, top_k = truncation
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 49_152, generator=generator) * 3  # a real vocabulary (SmolLM2's)
    uniforms = torch.rand(8, generator=generator)

    def sample(rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        count = len(range(8)[rows])
        params = RowParams.build([1.0] * count, [top_p] * count, [top_k] * count, torch.device("cpu"))
        return sample_padded_rows(logits[rows], params, uniforms[rows])

    tokens, log_probs = sample(slice(0, 8))
    for row in range(8):
        alone_tokens, alone_log_probs = sample(slice(row, row + 1))
        assert torch.equal(alone_tokens, tokens[row : row + 1]), row
        assert torch.equal(alone_log_probs, log_probs[row : row + 1]), row


@pytest.mark.integration
def test_a_sequence_decodes_to_the_same_bits_alone_and_inside_batches_of_any_size(tiny_model_path: Path) -> None:
    check_decoding_is_batch_invariant(tiny_model_path, "cpu")


async def _generate(engine: TorchEngine, prompt: list[int], request_id: str, seed: int) -> tuple[list[int], list]:
    params = SamplingParams(temperature=1.0, max_new_tokens=24, n=2, seed=seed, ignore_eos=True)
    outputs = await engine.generate(GenerateRequest(request_id, prompt, params))
    return [output.output_ids for output in outputs], [output.log_probs for output in outputs]


@pytest.mark.integration
async def test_the_deterministic_engine_samples_the_same_tokens_and_log_probs_in_any_company(
    tiny_model_path: Path,
) -> None:
    prompts = sample_prompts()
    async with TorchEngine.from_pretrained(tiny_model_path, deterministic=True) as engine:
        alone = await _generate(engine, prompts[0], "alone", seed=7)
        crowd = await asyncio.gather(
            *(_generate(engine, prompt, f"other-{index}", seed=index) for index, prompt in enumerate(prompts[1:9])),
            _generate(engine, prompts[0], "crowded", seed=7),
            *(_generate(engine, prompt, f"late-{index}", seed=index) for index, prompt in enumerate(prompts[9:])),
        )
    assert crowd[8] == alone  # tokens and log-probs, compared as Python floats: every bit


@pytest.mark.integration
async def test_the_engine_refuses_a_model_that_does_not_dispatch_attention(tiny_model_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    model.set_attn_implementation = None  # as on a model class outside transformers' AttentionInterface
    with pytest.raises(RuntimeError, match="set_attn_implementation"):
        TorchEngine(model, None, deterministic=True)
