"""One sequence the torch engine is generating, and what it hands back when it is done.

Both batchers (`batcher.py`, `static_batcher.py`) and the engine's control commands share this record: the
batchers fill it a token at a time, the engine turns it into a `GenerateOutput` when it finishes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engines.inference.base import FinishReason, GenerateOutput, RoutedExperts, SamplingParams
from engines.inference.vision_rows import PromptVision


@dataclass(eq=False)
class DecodingSequence:
    """One sequence being generated: sample `sample_index` of request `request_id`.

    Invariant while running: the KV cache holds every token of `prompt_ids + output_ids` except the last
    output token, which is the next decode step's input.
    """

    request_id: str
    sample_index: int
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int  # the request's budget, clamped to the model's context
    stop_token_ids: frozenset[int]  # the request's stop ids plus the model's EOS ids unless ignore_eos
    generator: torch.Generator | None = None  # seeded requests only
    seed: int | None = None  # the sample's own seed (seeded requests; the static batcher draws one for the rest)
    adapter: str | None = None  # the LoRA adapter its forwards run with (`multi_lora.py`); None: the base weights
    vision: PromptVision | None = None  # its prompt's images (vision-language models), its request's samples share it
    output_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    # With recorded routes: [tokens, layers, top_k] int16 chunks, one per prefill (which replaces them: it
    # recomputes every token so far) and one per decode step (the token fed in). See `base.RoutedExperts`.
    routes: list[torch.Tensor] = field(default_factory=list)
    # The oldest weight version among the keys and values its cache row holds (None: not in the cache). Set by
    # the prefill that computes them, not by whoever drops the cache, so a drop that did not happen shows.
    kv_version: int | None = None
    kv_epoch: int | None = None  # likewise the oldest weights epoch (`ContinuousBatcher.weights_epoch`)
    cached_tokens: int = 0  # tokens whose keys and values its prefills took from the prefix cache
    stale_cached_tokens: int = 0  # tokens the prefix cache held for it from older weights, prefilled again
    reprefilled_tokens: int = 0  # tokens prefilled again because a weight update dropped its cache row

    @property
    def key(self) -> tuple[str, int]:
        return (self.request_id, self.sample_index)

    @property
    def worst_case_length(self) -> int:
        return len(self.prompt_ids) + self.max_new_tokens

    def finish(self, reason: FinishReason, matched_stop: str | int | None = None) -> None:
        self.finish_reason = reason
        self.matched_stop = matched_stop

    def to_output(self) -> GenerateOutput:
        if self.finish_reason is None:
            raise RuntimeError(f"sample {self.key} is still running; it has no output yet")
        return GenerateOutput(
            request_id=self.request_id,
            output_ids=list(self.output_ids),
            log_probs=list(self.log_probs),
            versions=list(self.versions),
            finish_reason=self.finish_reason,
            sample_index=self.sample_index,
            prompt_len=len(self.prompt_ids),
            matched_stop=self.matched_stop,
            routed_experts=routed_experts(self.routes),
            cached_tokens=self.cached_tokens,
            stale_cached_tokens=self.stale_cached_tokens,
            reprefilled_tokens=self.reprefilled_tokens,
        )


def append_tokens(samples: list[DecodingSequence], tokens: list[int], log_probs: list[float],
                  versions: list[int]) -> None:
    """Each sample's newest token, its log-prob and the weight version that sampled it (host lists)."""
    for sample, token, log_prob, version in zip(samples, tokens, log_probs, versions, strict=True):
        sample.output_ids.append(token)
        sample.log_probs.append(log_prob)
        sample.versions.append(version)



def routed_experts(routes: list[torch.Tensor]) -> RoutedExperts | None:
    if not routes:
        return None
    return RoutedExperts.of(torch.cat(routes).numpy())
