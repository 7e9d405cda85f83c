"""A minimum response length (`SamplingParams.min_new_tokens`) on the torch engine, as SGLang and HF's
`min_new_tokens` make it: until a sample has that many tokens, its stop and end-of-sequence ids are held back (their
logits -inf), so the sample cannot end there; the log-probs are those of the distribution it was drawn from."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engines.inference.decoding_sequence import DecodingSequence


def hold_back_stops(logits: torch.Tensor, samples: Sequence[DecodingSequence]) -> torch.Tensor:
    """`logits` ([rows, vocab], one row per sample) with each short sample's stop ids at -inf (a copy; the same
    tensor when no row is held)."""
    rows: list[int] = []
    tokens: list[int] = []
    vocab = logits.shape[-1]
    for row, sample in enumerate(samples):
        if len(sample.output_ids) < sample.params.min_new_tokens:
            held = [token for token in sample.stop_token_ids if token < vocab]
            rows += [row] * len(held)
            tokens += held
    if not rows:
        return logits
    held_back = logits.clone()
    held_back[torch.tensor(rows, device=logits.device), torch.tensor(tokens, device=logits.device)] = float("-inf")
    return held_back
