"""Teacher-forced log-probs of given tokens under the engine's model: what `TorchEngine.score` answers (a teacher's
log-probs for distillation, a judge's). Only the positions that predict the scored tokens get logits, never the
prompt's, and at most SCORE_LOGITS_ELEMENTS of them at once: a long answer over a large vocabulary is scored in
windows, each a forward of the sequence up to its last token (more compute, never [answer x vocabulary] floats)."""

from __future__ import annotations

import torch
from torch import nn

SCORE_LOGITS_ELEMENTS = 1 << 25  # float32 logits one scoring forward may hold (128 MiB)


def score_tokens(model: nn.Module, vocab_size: int, input_ids: list[int], start: int,
                 temperature: float) -> list[float]:
    """The log-prob of each token of `input_ids[start:]` given the tokens before it, at `temperature`."""
    device = next(model.parameters()).device
    ids = torch.tensor([input_ids], dtype=torch.long, device=device)
    window = max(1, SCORE_LOGITS_ELEMENTS // vocab_size)
    scores: list[float] = []
    for first in range(start, len(input_ids), window):
        end = min(first + window, len(input_ids))  # scores tokens first..end-1
        logits = model(ids[:, :end], logits_to_keep=end - first + 1, use_cache=False).logits[0, :-1]
        log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
        scores += log_probs.gather(-1, ids[0, first:end].unsqueeze(-1)).squeeze(-1).cpu().tolist()
    return scores
