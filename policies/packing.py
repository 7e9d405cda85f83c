"""Segment helpers for the packed layout every policy function uses.

A batch of ``B`` variable-length responses is ONE 1-D tensor of ``T = response_lengths.sum()`` per-token values,
concatenated in sample order, plus ``response_lengths: LongTensor[B]``. No padding travels between actors or
reaches the loss, so a 2-token answer next to an 8k-token one costs 2 tokens, not 8k.

Everything here is vectorised over samples (``index_add_``/``repeat_interleave``); the only Python loops are over
chunks of a time axis (the discounted scan), never over samples. The loop-based references live in the tests.

Masked positions are "don't care": :func:`zero_masked` replaces them with 0 before any arithmetic, because a NaN
at a masked position would otherwise survive ``x * 0`` and poison the whole loss.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "as_compute_dtype",
    "as_float_mask",
    "check_finite",
    "check_lengths",
    "check_packed",
    "discounted_cumsum",
    "group_index",
    "last_masked_index",
    "masked_max",
    "masked_mean",
    "masked_min",
    "masked_std",
    "masked_sum",
    "pad_packed",
    "per_sample_count",
    "per_sample_mean",
    "per_sample_sum",
    "sample_index",
    "split_packed",
    "to_tokens",
    "unpad",
    "zero_masked",
]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def as_compute_dtype(tensor: Tensor) -> Tensor:
    """Upcast half/bfloat16 (and integers) to float32; float32/float64 pass through unchanged.

    Losses and advantages are sums over thousands of tokens; bf16 has 8 mantissa bits, so we never reduce in it.
    float64 is kept so the tests can compare against float64 references at 1e-10.
    """
    if tensor.dtype in (torch.float32, torch.float64):
        return tensor
    return tensor.to(torch.float32)


def check_lengths(response_lengths: Tensor) -> Tensor:
    """Validate ``response_lengths`` (1-D, integer, non-negative) and return it as int64.

    Zero-length responses are allowed: they contribute no tokens and count as all-masked samples.
    """
    if not isinstance(response_lengths, Tensor):
        raise TypeError(f"response_lengths: expected a LongTensor[B], got {type(response_lengths).__name__}")
    if response_lengths.dim() != 1:
        raise ValueError(f"response_lengths: expected shape [B], got {tuple(response_lengths.shape)}")
    if response_lengths.dtype.is_floating_point or response_lengths.dtype == torch.bool:
        raise ValueError(f"response_lengths: expected an integer tensor, got {response_lengths.dtype}")
    if response_lengths.numel() and int(response_lengths.min()) < 0:
        raise ValueError(f"response_lengths: negative length at sample {int(response_lengths.argmin())}")
    return response_lengths.long()


def check_packed(name: str, tensor: Tensor, response_lengths: Tensor) -> None:
    """Raise a ValueError naming ``name`` unless ``tensor`` is a packed 1-D tensor matching ``response_lengths``."""
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{name}: expected a packed 1-D tensor, got {type(tensor).__name__}")
    total = int(response_lengths.sum()) if response_lengths.numel() else 0
    if tensor.dim() != 1 or tensor.numel() != total:
        raise ValueError(
            f"{name}: expected a packed 1-D tensor of {total} tokens (sum of response_lengths), "
            f"got shape {tuple(tensor.shape)}"
        )


def check_finite(name: str, tensor: Tensor, mask: Tensor | None = None) -> None:
    """Raise a ValueError naming ``name`` and the first bad position if ``tensor`` holds NaN/inf where mask is set.

    Positions outside the mask are ignored: engines legitimately report junk log-probs for tokens that are not
    trained (tool outputs, padding), and those never enter the loss.
    """
    bad = ~torch.isfinite(tensor)
    if mask is not None:
        bad = bad & (mask > 0)
    if bool(bad.any()):
        index = int(bad.nonzero()[0, 0]) if bad.dim() else 0
        value = float(tensor.reshape(-1)[index]) if tensor.dim() else float(tensor)
        raise ValueError(f"{name}: non-finite value {value} at index {index}")


def as_float_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool/int/float loss mask as a 0/1 float tensor of ``dtype`` (any non-zero entry counts as trained)."""
    return (mask != 0).to(dtype)


def zero_masked(values: Tensor, mask: Tensor) -> Tensor:
    """``values`` with every position outside ``mask`` replaced by 0 (gradient still flows at kept positions)."""
    return torch.where(mask > 0, values, torch.zeros((), dtype=values.dtype, device=values.device))


def sample_index(response_lengths: Tensor) -> Tensor:
    """``LongTensor[T]``: for each packed token, the index of the sample it belongs to."""
    lengths = response_lengths.long()
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)


def to_tokens(sample_values: Tensor, response_lengths: Tensor) -> Tensor:
    """Broadcast per-sample values ``[B]`` to packed per-token values ``[T]``."""
    return torch.repeat_interleave(sample_values, response_lengths.long())


def per_sample_sum(values: Tensor, response_lengths: Tensor, mask: Tensor | None = None) -> Tensor:
    """``Tensor[B]``: sum of ``values`` (times ``mask`` if given) over each sample's tokens; 0 for empty samples."""
    weighted = values if mask is None else values * mask
    out = torch.zeros(response_lengths.numel(), dtype=weighted.dtype, device=weighted.device)
    return out.index_add(0, sample_index(response_lengths), weighted)


def per_sample_count(mask: Tensor, response_lengths: Tensor) -> Tensor:
    """``Tensor[B]``: number of masked-in tokens of each sample (float, same dtype as ``mask``)."""
    return per_sample_sum(mask, response_lengths)


def per_sample_mean(values: Tensor, response_lengths: Tensor, mask: Tensor) -> Tensor:
    """``Tensor[B]``: masked mean of each sample; an all-masked (or empty) sample gives 0, not NaN."""
    return per_sample_sum(values, response_lengths, mask) / per_sample_count(mask, response_lengths).clamp_min(1)


def masked_sum(values: Tensor, mask: Tensor) -> Tensor:
    return (values * mask).sum()


def masked_mean(values: Tensor, mask: Tensor, denominator: float | Tensor | None = None) -> Tensor:
    """Sum of masked values divided by ``denominator`` (default: the local mask count, at least 1).

    Passing the global token count of the whole batch as ``denominator`` is what makes micro-batch losses add up
    to the full-batch loss.
    """
    if denominator is None:
        denominator = mask.sum().clamp_min(1)
    return (values * mask).sum() / denominator


def masked_std(values: Tensor, mask: Tensor) -> Tensor:
    """Population standard deviation over masked positions (0 when fewer than one token is masked in)."""
    mean = masked_mean(values, mask)
    return masked_mean((values - mean) ** 2, mask).sqrt()


def masked_max(values: Tensor, mask: Tensor) -> Tensor:
    """Max over masked positions; 0 when nothing is masked in (a metric, so no -inf leaks into logs)."""
    if not bool((mask > 0).any()):
        return torch.zeros((), dtype=values.dtype, device=values.device)
    return values[mask > 0].max()


def masked_min(values: Tensor, mask: Tensor) -> Tensor:
    """Min over masked positions; 0 when nothing is masked in."""
    if not bool((mask > 0).any()):
        return torch.zeros((), dtype=values.dtype, device=values.device)
    return values[mask > 0].min()


def split_packed(values: Tensor, response_lengths: Tensor) -> list[Tensor]:
    """Per-sample views of a packed tensor (for tests, debugging and user plugins)."""
    return list(torch.split(values, response_lengths.long().tolist()))


def pad_packed(values: Tensor, response_lengths: Tensor, pad_value: float = 0.0) -> Tensor:
    """``[T] -> [B, max_len]`` right-padded with ``pad_value``."""
    lengths = response_lengths.long()
    batch = lengths.numel()
    max_len = int(lengths.max()) if batch else 0
    out = torch.full((batch, max_len), pad_value, dtype=values.dtype, device=values.device)
    positions = torch.arange(max_len, device=values.device).expand(batch, max_len)
    valid = positions < lengths.unsqueeze(1)
    out[valid] = values
    return out


def unpad(padded: Tensor, response_lengths: Tensor) -> Tensor:
    """``[B, max_len] -> [T]``: the inverse of :func:`pad_packed`."""
    lengths = response_lengths.long()
    positions = torch.arange(padded.shape[1], device=padded.device).expand_as(padded)
    return padded[positions < lengths.unsqueeze(1)]


def last_masked_index(mask: Tensor, response_lengths: Tensor) -> Tensor:
    """``LongTensor[B]``: packed index of each sample's last masked-in token.

    Falls back to the sample's last token when the sample is all-masked, and to -1 for a zero-length sample.
    Terminal rewards go here: the last token the policy is trained on is the one that "ended" the response.
    """
    lengths = response_lengths.long()
    ends = torch.cumsum(lengths, 0) - 1
    positions = torch.arange(mask.numel(), device=mask.device)
    keyed = torch.where(mask > 0, positions, torch.full_like(positions, -1))
    last = torch.full((lengths.numel(),), -1, dtype=torch.long, device=mask.device)
    last = last.scatter_reduce(0, sample_index(lengths), keyed, reduce="amax", include_self=True)
    fallback = torch.where(lengths > 0, ends, torch.full_like(ends, -1))
    return torch.where(last >= 0, last, fallback)


def group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary group ids to ``0..G-1``: returns ``(inverse LongTensor[B], G)``.

    Groups need not be contiguous or equal-sized; ids are only compared for equality.
    """
    if group_ids.dim() != 1:
        raise ValueError(f"group_ids: expected shape [B], got {tuple(group_ids.shape)}")
    unique, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, unique.numel()


def discounted_cumsum(values: Tensor, response_lengths: Tensor, discount: float, chunk: int = 64) -> Tensor:
    """Per sample, ``out[t] = sum_{k >= t} discount**(k - t) * values[k]`` (a reverse discounted scan), packed.

    Why chunked: a token-by-token backward loop costs one kernel launch per position of the longest response
    (8k+ for reasoning models). Within a chunk of ``chunk`` positions the scan is one matmul with the upper
    triangular matrix ``discount**(j - i)``; chunks are then chained by carrying the running sum, so the Python
    loop is ``max_len / chunk`` iterations over the whole batch at once.
    """
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"discount: expected a value in [0, 1], got {discount}")
    lengths = response_lengths.long()
    if values.numel() == 0:
        return values.clone()
    padded = pad_packed(values, lengths)  # zeros after each sample's end leave the scan untouched
    batch, max_len = padded.shape
    if discount == 1.0:
        scanned = padded.flip(1).cumsum(1).flip(1)
        return unpad(scanned, lengths)
    n_chunks = -(-max_len // chunk)
    width = n_chunks * chunk
    padded = torch.nn.functional.pad(padded, (0, width - max_len))
    idx = torch.arange(chunk, device=values.device)
    base = torch.tensor(discount, dtype=values.dtype, device=values.device)
    power = (idx.unsqueeze(0) - idx.unsqueeze(1)).to(values.dtype)  # power[i, j] = j - i
    within = torch.where(power >= 0, torch.pow(base, power.clamp_min(0)), 0)
    carry_scale = torch.pow(base, (chunk - idx).to(values.dtype))
    out = torch.empty_like(padded)
    carry = torch.zeros(batch, dtype=values.dtype, device=values.device)
    for c in reversed(range(n_chunks)):
        block = padded[:, c * chunk : (c + 1) * chunk]
        local = block @ within.T  # local[b, i] = sum_{j >= i} discount**(j - i) * block[b, j]
        out[:, c * chunk : (c + 1) * chunk] = local + carry.unsqueeze(1) * carry_scale
        carry = out[:, c * chunk]
    return unpad(out[:, :max_len], lengths)
