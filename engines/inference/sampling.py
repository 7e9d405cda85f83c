"""Turn next-token logits into sampled tokens and the log-probs of the distribution they were drawn from.

Everything is vectorized over the batch with per-row parameters, because a continuous batch mixes requests
with different temperatures, truncations and seeds. Randomness enters only through one uniform number per
sampled row (inverse-CDF sampling), so a seeded request draws exactly one number per token from its own
generator and its samples do not depend on which other requests share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowParams:
    """Per-row sampling parameters as tensors of shape [rows]; build once per batch composition."""

    temperature: torch.Tensor  # float32; 0 = greedy
    top_p: torch.Tensor  # float32; 1 = off
    top_k: torch.Tensor  # int64; 0 = off
    any_sampled: bool
    any_greedy: bool
    any_truncated: bool

    @classmethod
    def build(
        cls, temperatures: list[float], top_ps: list[float], top_ks: list[int], device: torch.device
    ) -> RowParams:
        any_greedy = any(t == 0 for t in temperatures)
        any_sampled = not all(t == 0 for t in temperatures)
        any_truncated = any(t > 0 and (p < 1 or k > 0) for t, p, k in zip(temperatures, top_ps, top_ks, strict=True))
        return cls(
            temperature=torch.tensor(temperatures, dtype=torch.float32, device=device),
            top_p=torch.tensor(top_ps, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_ks, dtype=torch.int64, device=device),
            any_sampled=any_sampled,
            any_greedy=any_greedy,
            any_truncated=any_truncated,
        )


def sample_next_tokens(
    logits: torch.Tensor, params: RowParams, uniforms: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; returns (token ids [rows] int64, log-probs [rows] float32).

    `logits` is [rows, vocab] and is upcast to float32, because the log-probs must match the trainer's
    fp32 `log_softmax(logits / T)` to ~1e-5. `uniforms` ([rows], values in [0, 1)) drive sampled rows and
    may be None when every row is greedy. Greedy rows (T=0) take the argmax and report `log_softmax(logits)`.
    Sampled rows report the log-prob under the distribution they were drawn from: the temperature-scaled
    softmax, renormalized over the top-k/top-p survivors when truncation is on.
    """
    logits = logits.float()
    greedy_rows = params.temperature == 0
    scale = torch.where(greedy_rows, torch.ones_like(params.temperature), params.temperature)
    log_probs = torch.log_softmax(logits / scale.unsqueeze(-1), dim=-1)

    if not params.any_sampled:
        tokens = logits.argmax(dim=-1)
        return tokens, log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    if uniforms is None:
        raise ValueError("sample_next_tokens: uniforms are required when some row samples (temperature > 0)")

    sampling_log_probs = truncate(log_probs, params) if params.any_truncated else log_probs
    tokens = inverse_cdf_sample(sampling_log_probs.exp(), uniforms)
    if params.any_greedy:
        tokens = torch.where(greedy_rows, logits.argmax(dim=-1), tokens)
        sampling_log_probs = torch.where(greedy_rows.unsqueeze(-1), log_probs, sampling_log_probs)
    return tokens, sampling_log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def truncate(log_probs: torch.Tensor, params: RowParams) -> torch.Tensor:
    """Mask rows to their top-k / top-p survivors and renormalize; rows with both off are returned unchanged.

    Both cuts are prefixes of the tokens sorted by probability, measured on the untruncated distribution,
    so their intersection is the shorter prefix. Top-p keeps the token that crosses the threshold (the first
    token always survives).
    """
    sorted_log_probs, order = log_probs.sort(dim=-1, descending=True)
    vocab = log_probs.shape[-1]
    rank = torch.arange(vocab, device=log_probs.device).unsqueeze(0)
    keep_sorted = (params.top_k.unsqueeze(-1) == 0) | (rank < params.top_k.unsqueeze(-1))
    sorted_probs = sorted_log_probs.exp()
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    top_p = params.top_p.unsqueeze(-1)
    # top_p=1 is "off" explicitly: an fp32 cumsum can reach 1.0 before the tail, which would cut real tokens.
    keep_sorted &= (top_p >= 1) | (mass_before < top_p)
    keep_sorted[:, 0] = True
    keep = torch.empty_like(keep_sorted).scatter_(-1, order, keep_sorted)
    masked = log_probs.masked_fill(~keep, float("-inf"))
    return masked - torch.logsumexp(masked, dim=-1, keepdim=True)


def inverse_cdf_sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Pick per row the first token whose cumulative probability exceeds `u * total`.

    The cumulative sum runs in float64 and the search is strict (`right=True`), so with u in [0, 1) the
    chosen token always has non-zero probability: a truncated-away token can never be returned, however
    close u gets to 1 (an fp32 cumsum would occasionally land on the vocabulary's last, masked, entry).
    """
    cdf = probs.double().cumsum(dim=-1)
    targets = uniforms.double().unsqueeze(-1) * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, targets, right=True).squeeze(-1)
    return tokens.clamp_(max=probs.shape[-1] - 1)


_LOW16 = 0xFFFF
_LOW32 = 0xFFFFFFFF


def counter_uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One uniform in [0, 1) per row, a pure function of (seed, position) computed on the rows' device.

    What makes a sample reproducible without a generator per row: the draw for the token at `position` of the
    sample seeded `seed` is the same whichever rows share the batch, on any device and after any re-prefill, and
    nothing runs on the host, so a captured CUDA graph can draw it. `seeds` ([rows] int64, >= 0) and `positions`
    ([rows] int64, the position the sampled token will have) are hashed by two rounds of a 32-bit integer mix.
    The arithmetic stays below 2**63 (16-bit halves of each multiplier), because int64 overflow is not defined
    alike on every device. The result has 53 random bits, a float64 the inverse-CDF sampler uses as is.
    """
    seed_low, seed_high = seeds & _LOW32, (seeds >> 32) & _LOW32
    first = _mix32(seed_low ^ _mix32(seed_high ^ _mix32((positions ^ 0x9E3779B9) & _LOW32)))  # mix32(0) is 0
    second = _mix32(first ^ 0x5BD1E995)
    bits = ((first >> 6) << 27) | (second >> 5)  # 26 + 27 bits
    return bits.double() / float(1 << 53)


def _mix32(values: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche mix (xor-shift, multiply, twice) of non-negative int64 values below 2**32."""
    values = values ^ (values >> 16)
    values = _multiply32(values, 0x7FEB352D)
    values = values ^ (values >> 15)
    values = _multiply32(values, 0x846CA68B)
    return values ^ (values >> 16)


def _multiply32(values: torch.Tensor, factor: int) -> torch.Tensor:
    """(values * factor) mod 2**32 for values below 2**32, every intermediate below 2**49."""
    low = values * (factor & _LOW16)
    high = ((values * (factor >> 16)) & _LOW16) << 16
    return (low + high) & _LOW32
