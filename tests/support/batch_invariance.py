"""A sequence decoded alone and amid other sequences, through the same KV-batch path the torch engine takes."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from engines.inference.batch_invariant import make_batch_invariant
from engines.inference.kv_batch import KVBatch

DECODE_STEPS = 40


def sample_prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    lengths = (12, 7, 20, 3, 15, 9, 30, 11, 5, 8, 13, 17, 19, 2, 4, 6, 25, 14, 16, 18, 21, 33, 34, 35, 36, 37)
    return [torch.randint(5, 100, (n,), generator=generator).tolist() for n in lengths]


def decode_logits(model: torch.nn.Module, prompts: list[list[int]], row: int) -> torch.Tensor:
    """Row `row`'s logits at prefill and after each decode step, every row fed the same token sequence."""
    feed = torch.randint(5, 100, (DECODE_STEPS,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        batch, logits = KVBatch.empty(model.device), []
        for prompt in prompts:  # one prefill per sequence, as the batch-invariant engine prefills
            alone, last = KVBatch.prefill(model, [prompt], pad_token_id=0)
            batch.extend(alone)
            logits.append(last)
        steps = [torch.cat(logits)[row]]
        for token in feed.tolist():
            steps.append(batch.decode(model, torch.full((batch.rows,), token, device=model.device))[row])
    return torch.stack(steps).cpu()


def check_decoding_is_batch_invariant(model_path: Path, device: str) -> None:
    stock = AutoModelForCausalLM.from_pretrained(model_path).to(device).eval()
    invariant = AutoModelForCausalLM.from_pretrained(model_path).to(device).eval()
    make_batch_invariant(invariant)
    prompts = sample_prompts()
    alone = decode_logits(invariant, prompts[:1], row=0)
    for others in (1, 2, 5, 12, 25):
        batch = prompts[1 : others + 1]
        middle = len(batch) // 2
        # the sequence first, and in the middle of rows with other lengths (other left padding)
        assert torch.equal(decode_logits(invariant, prompts[:1] + batch, row=0), alone), others
        assert torch.equal(decode_logits(invariant, batch[:middle] + prompts[:1] + batch[middle:], row=middle), alone)
    # the same function as the stock model computes, to float32 rounding
    torch.testing.assert_close(alone, decode_logits(stock, prompts[:1], row=0), rtol=0, atol=1e-5)
