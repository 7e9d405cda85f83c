"""Delta pushes: what changed in a tensor since the version the engines hold, in the fewest bytes, applied exactly.

A full push sends every element. Between two versions of full fine-tuning most elements of the WIRE dtype keep their
bits (tools/bench/weight_deltas.py measures how many: bfloat16 rounds away most of an Adam step), so after a full
push (the anchor) a push may send per tensor only its changed elements. "Changed" compares bits, not values: -0.0
and 0.0 differ, a NaN equals itself, so the receiver's copy ends bit for bit equal to the sender's.

Each tensor travels in whichever encoding is smallest for it, chosen from the count of changed elements:
- ``dense``: every element (what a full push sends);
- ``sparse``: the changed elements' flat indices (int32, int64 past 2^31 elements), then their new values;
- ``bitmap``: one bit per element (set where it changed), then the changed elements' new values.
New values, never differences: applying one is an overwrite, exact whatever the dtype, and a second application
changes nothing. Both ends know each tensor's encoding and count from the manifest before any byte moves, so the
encoded bytes travel as one uint8 tensor per tensor, bucketed like any push (`Manifest.wire`).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor

DENSE, SPARSE, BITMAP = "dense", "sparse", "bitmap"
ENCODINGS = (DENSE, SPARSE, BITMAP)
_INT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BIT_PLACES = 1 << torch.arange(8, dtype=torch.uint8)


def _bits(tensor: Tensor) -> Tensor:
    """The tensor's elements as integers of the same width (a flat view): equal exactly when the bits are."""
    flat = tensor.reshape(-1)
    return flat.view(torch.uint8) if flat.dtype == torch.bool else flat.view(_INT_VIEWS[flat.element_size()])


# Each step below has a CPU form in numpy (zero-copy views of the tensors): torch's boolean indexing, nonzero and
# bit packing run one thread at 5-20x numpy's time on a CPU (measured on a 576 x 1536 bfloat16 matrix); on a GPU,
# torch's kernels are the ones to use.


def changed(old: Tensor, new: Tensor) -> Tensor:
    """A flat bool mask of the elements whose bits differ between two tensors of one dtype and shape."""
    if old.device.type == "cpu" and new.device.type == "cpu":
        return torch.from_numpy(_bits(old).numpy() != _bits(new).numpy())
    return _bits(old) != _bits(new)


def count(mask: Tensor) -> int:
    """How many elements `changed` marks."""
    return int(np.count_nonzero(mask.numpy())) if mask.device.type == "cpu" else int(mask.sum())


def _positions(mask: Tensor) -> Tensor:
    """The flat int64 indices where `mask` is set, in order."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(mask.numpy()))
    return mask.nonzero().reshape(-1)


def _take(bits: Tensor, positions: Tensor) -> Tensor:
    if bits.device.type == "cpu":
        return torch.from_numpy(bits.numpy()[positions.numpy()])
    return bits[positions]


def _put(bits: Tensor, positions: Tensor, values: Tensor) -> None:
    if bits.device.type == "cpu":
        bits.numpy()[positions.numpy()] = values.numpy()
    else:
        bits[positions] = values


def pack_bits(mask: Tensor) -> Tensor:
    """A bool mask as bytes, eight elements per byte, the first in the lowest bit."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.packbits(mask.numpy(), bitorder="little"))
    padded = torch.zeros((mask.numel() + 7) // 8 * 8, dtype=torch.uint8, device=mask.device)
    padded[: mask.numel()] = mask.reshape(-1)
    return (padded.view(-1, 8) * _BIT_PLACES.to(mask.device)).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: Tensor, numel: int) -> Tensor:
    if packed.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(packed.numpy(), count=numel, bitorder="little").view(np.bool_))
    return ((packed.unsqueeze(1) & _BIT_PLACES.to(packed.device)) != 0).reshape(-1)[:numel]


def _index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


def _pad8(nbytes: int) -> int:
    """Values start 8-byte aligned after the indices or bits, so they view as any dtype in place."""
    return (nbytes + 7) // 8 * 8


def encoded_nbytes(encoding: str, numel: int, count: int, itemsize: int) -> int:
    """Bytes of a tensor of `numel` elements of `itemsize` bytes, `count` of them changed, in `encoding`."""
    if encoding == DENSE:
        return numel * itemsize
    if encoding == SPARSE:
        return (_pad8(count * _index_dtype(numel).itemsize) + count * itemsize) if count else 0
    if encoding == BITMAP:
        return _pad8((numel + 7) // 8) + count * itemsize
    raise ValueError(f"delta encoding: expected one of {ENCODINGS}, got {encoding!r}")


def smallest(numel: int, count: int, itemsize: int) -> str:
    """The encoding of fewest bytes; dense on a tie (the cheapest to apply)."""
    return min(ENCODINGS, key=lambda encoding: encoded_nbytes(encoding, numel, count, itemsize))


def encode(encoding: str, mask: Tensor, new: Tensor) -> Tensor:
    """The bytes that carry `new`'s elements where `mask` is set, as uint8 (dense: `new`'s own bytes, a view)."""
    if encoding not in ENCODINGS:
        raise ValueError(f"delta encoding: expected one of {ENCODINGS}, got {encoding!r}")
    bits = _bits(new)
    if encoding == DENSE:
        return bits.view(torch.uint8)
    positions = _positions(mask)
    if encoding == SPARSE and not positions.numel():
        return torch.empty(0, dtype=torch.uint8, device=new.device)
    head_bytes = positions.numel() * _index_dtype(bits.numel()).itemsize if encoding == SPARSE else (
        (bits.numel() + 7) // 8)
    out = torch.zeros(_pad8(head_bytes) + positions.numel() * bits.element_size(), dtype=torch.uint8,
                      device=new.device)
    # written through typed views of `out`: a one-element result may carry a stride that refuses a dtype view
    if encoding == SPARSE:
        out[:head_bytes].view(_index_dtype(bits.numel())).copy_(positions)
    else:
        out[:head_bytes] = pack_bits(mask)
    out[_pad8(head_bytes):].view(bits.dtype).copy_(_take(bits, positions))
    return out


def apply(encoding: str, payload: Tensor, count: int, target: Tensor, dtype: torch.dtype | None = None) -> None:
    """Overwrite `target`'s changed elements in place from `payload` (uint8, as `encode` made it of values of
    `dtype`, by default `target`'s own; a wider float target takes them exactly cast). `target` must be
    contiguous: its elements are written through a flat view."""
    if not target.is_contiguous():
        raise ValueError(f"delta target of shape {list(target.shape)} is not contiguous")
    target = target.detach()  # an engine's parameter: written as data, never through autograd
    dtype = target.dtype if dtype is None else dtype
    numel = target.numel()
    expected = encoded_nbytes(encoding, numel, count, dtype.itemsize)
    if payload.numel() != expected:
        raise ValueError(f"delta payload of {payload.numel()} bytes, expected {expected} for {count} changed "
                         f"of {numel} {dtype} elements in {encoding}")
    if encoding == DENSE:
        if dtype == target.dtype:
            _bits(target).view(torch.uint8).copy_(payload)
        else:
            target.view(-1).copy_(payload.view(dtype))
        return
    if count == 0:
        return
    if encoding == SPARSE:
        head = count * _index_dtype(numel).itemsize
        positions = payload[:head].view(_index_dtype(numel))
    else:
        head = (numel + 7) // 8
        positions = _positions(unpack_bits(payload[:head], numel))
        if positions.numel() != count:
            raise ValueError(f"delta bitmap marks {positions.numel()} changed elements, the manifest says {count}")
    values = payload[_pad8(head):].view(dtype)
    _put(_bits(target), positions, _bits(values if dtype == target.dtype else values.to(target.dtype)))


def wire_nbytes(itemsizes: Mapping[str, int], numels: Mapping[str, int], counts: Mapping[str, int]) -> int:
    """What a delta push with these changed counts sends, each tensor in its smallest encoding."""
    return sum(encoded_nbytes(smallest(numels[name], count, itemsizes[name]), numels[name], count, itemsizes[name])
               for name, count in counts.items())
