"""The torch engine on CUDA keeps its two reference properties (skipped without a GPU)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from engines.inference import GenerateRequest, SamplingParams, TorchEngine

PROMPTS = ["hi", "What is 12 * 7?", "Write a haiku about the sea, please."]


@pytest.mark.gpu
async def test_cuda_engine_greedy_equals_generate_and_log_probs_equal_a_full_forward(tiny_model_path: Path) -> None:
    async with TorchEngine.from_pretrained(tiny_model_path, device="cuda", max_batch_size=2) as engine:
        tokenizer, model = engine.tokenizer, engine.model
        prompts = [tokenizer.encode(text) for text in PROMPTS]
        params = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
        outputs = await asyncio.gather(
            *(engine.generate(GenerateRequest(f"p{i}", prompt, params)) for i, prompt in enumerate(prompts))
        )
        for prompt, [output] in zip(prompts, outputs, strict=True):
            with torch.no_grad():
                reference = model.generate(
                    torch.tensor([prompt], device="cuda"), max_new_tokens=20, do_sample=False, eos_token_id=None
                )[0, len(prompt) :].tolist()
                logits = model(torch.tensor([prompt + output.output_ids], device="cuda")).logits[0].float()
            assert output.output_ids == reference
            expected = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(
                -1, torch.tensor(output.output_ids, device="cuda")[:, None]
            )
            torch.testing.assert_close(torch.tensor(output.log_probs), expected.squeeze(-1).cpu(), rtol=0, atol=1e-4)
