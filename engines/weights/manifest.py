"""The manifest that precedes every transfer, and the bucket layout both ends derive from it.

The sender publishes names, dtypes and shapes (and the bucket size) before any bytes move; each receiver then
computes the SAME bucket plan from the manifest alone, so buckets carry raw bytes with no per-bucket headers
and a receiver can allocate, post the next receive and slice views without further coordination.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from engines.weights import delta
from engines.weights.fingerprint import ALGORITHMS, FingerprintPlan

# Byte offsets inside a bucket are multiples of this, so every slice can be viewed as any dtype in place.
ALIGNMENT = 64
MANIFEST_FORMAT = 1
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class Bucket:
    """Tensors (by manifest index) and their byte offsets inside one broadcast buffer of `nbytes`."""

    entries: tuple[tuple[int, int], ...]
    nbytes: int


@dataclass(frozen=True)
class Manifest:
    version: int
    bucket_bytes: int
    direct_bytes: int
    tensors: tuple[TensorSpec, ...]
    fingerprint: str | None = None  # the algorithm both ends fingerprint the tensors with (`fingerprint.py`), if any
    fingerprint_stride: int = 1  # ... over one of this many slices of their rows (`FingerprintPlan`)
    keep: bool = False  # the receivers keep a copy of what they hold, so later pushes may be deltas against it
    base_version: int | None = None  # a delta push against this version; None: every tensor whole
    changes: tuple[tuple[str, int], ...] = ()  # a delta push's (encoding, changed elements) per tensor, in order

    @property
    def is_delta(self) -> bool:
        return self.base_version is not None

    def wire(self) -> Manifest:
        """The manifest of the bytes that travel: this one for a full push; for a delta, each tensor's encoded bytes
        as a uint8 tensor (`delta.py`), bucketed the same way, so the collective's plan is derived as for any push."""
        if self.base_version is None:
            return self
        encoded = tuple(
            TensorSpec(spec.name, torch.uint8,
                       (delta.encoded_nbytes(encoding, spec.numel, count, spec.dtype.itemsize),))
            for spec, (encoding, count) in zip(self.tensors, self.changes, strict=True))
        return Manifest(version=self.version, bucket_bytes=self.bucket_bytes, direct_bytes=self.direct_bytes,
                        tensors=encoded)

    def fingerprint_plan(self) -> FingerprintPlan | None:
        """What both ends fingerprint in this push; None: the sender asked for no fingerprints."""
        if self.fingerprint is None:
            return None
        return FingerprintPlan(self.fingerprint, self.fingerprint_stride, self.version)

    @property
    def total_bytes(self) -> int:
        return sum(spec.nbytes for spec in self.tensors)

    def buckets(self) -> list[Bucket]:
        return plan_buckets(self.tensors, self.bucket_bytes, self.direct_bytes)

    def encode(self) -> bytes:
        if any(spec.dtype not in _DTYPE_NAMES for spec in self.tensors):
            bad = next(spec for spec in self.tensors if spec.dtype not in _DTYPE_NAMES)
            raise ValueError(f"tensor {bad.name!r}: dtype {bad.dtype} cannot be transferred")
        return json.dumps(
            {
                "format": MANIFEST_FORMAT,
                "version": self.version,
                "bucket_bytes": self.bucket_bytes,
                "direct_bytes": self.direct_bytes,
                "tensors": [[s.name, _DTYPE_NAMES[s.dtype], list(s.shape)] for s in self.tensors],
                "fingerprint": self.fingerprint,
                "fingerprint_stride": self.fingerprint_stride,
                "keep": self.keep,
                "base_version": self.base_version,
                "changes": [list(change) for change in self.changes],
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def decode(cls, data: bytes) -> Manifest:
        """Parse and validate; anything malformed is a ValueError saying what and where."""
        try:
            raw = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"weight manifest: not JSON ({error})") from error
        if not isinstance(raw, dict) or raw.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"weight manifest: expected format {MANIFEST_FORMAT}, got {str(raw)[:80]!r}")
        version, entries = raw.get("version"), raw.get("tensors")
        bucket_bytes, direct_bytes = raw.get("bucket_bytes"), raw.get("direct_bytes")
        if not isinstance(version, int):
            raise ValueError(f"weight manifest: bad version {version!r}")
        for key, value in (("bucket_bytes", bucket_bytes), ("direct_bytes", direct_bytes)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"weight manifest: {key} must be a positive integer, got {value!r}")
        if not isinstance(entries, list):
            raise ValueError("weight manifest: 'tensors' must be a list")
        fingerprint = raw.get("fingerprint")
        if fingerprint is not None and fingerprint not in ALGORITHMS:
            raise ValueError(f"weight manifest: fingerprint must be one of {ALGORITHMS} or null, got {fingerprint!r}")
        stride = raw.get("fingerprint_stride", 1)
        if not isinstance(stride, int) or isinstance(stride, bool) or stride < 1:
            raise ValueError(f"weight manifest: fingerprint_stride must be an integer >= 1, got {stride!r}")
        keep, base_version, changes = raw.get("keep", False), raw.get("base_version"), raw.get("changes", [])
        if not isinstance(keep, bool):
            raise ValueError(f"weight manifest: keep must be true or false, got {keep!r}")
        if base_version is not None and (not isinstance(base_version, int) or isinstance(base_version, bool)):
            raise ValueError(f"weight manifest: base_version must be an integer or null, got {base_version!r}")
        expected = len(entries) if base_version is not None else 0
        if not isinstance(changes, list) or len(changes) != expected or not all(
                isinstance(change, list) and len(change) == 2 and change[0] in delta.ENCODINGS
                and isinstance(change[1], int) and change[1] >= 0 for change in changes):
            raise ValueError(f"weight manifest: changes must list an (encoding in {delta.ENCODINGS}, count >= 0) per "
                             f"tensor of a delta push and nothing otherwise, got {str(changes)[:120]!r}")
        specs = []
        for index, entry in enumerate(entries):
            if (
                not isinstance(entry, list)
                or len(entry) != 3
                or not isinstance(entry[0], str)
                or entry[1] not in DTYPES
                or not isinstance(entry[2], list)
                or not all(isinstance(size, int) and size >= 0 for size in entry[2])
            ):
                raise ValueError(f"weight manifest: tensor entry {index} malformed: {str(entry)[:120]!r}")
            specs.append(TensorSpec(entry[0], DTYPES[entry[1]], tuple(entry[2])))
        return cls(version=version, bucket_bytes=bucket_bytes, direct_bytes=direct_bytes, tensors=tuple(specs),
                   fingerprint=fingerprint, fingerprint_stride=stride, keep=keep, base_version=base_version,
                   changes=tuple((encoding, count) for encoding, count in changes))


def plan_buckets(tensors: Sequence[TensorSpec], bucket_bytes: int, direct_bytes: int) -> list[Bucket]:
    """Coalesce tensors smaller than `direct_bytes` into buckets of up to `bucket_bytes`, in manifest order; every
    tensor of at least `direct_bytes` (or larger than a bucket) travels alone.

    Coalescing exists to amortise the fixed cost of a collective over many small tensors (norms, biases). A large
    tensor gains nothing from it and would cost a packing copy on each end; alone, it is sent straight from the
    sender's memory and can land straight in the receiver's live tensor. Manifest order (not size order) keeps a
    bucket's tensors adjacent in the model, which engines that fuse weights on load (q/k/v, gate/up) prefer.
    """
    if bucket_bytes <= 0 or direct_bytes <= 0:
        raise ValueError(f"bucket_bytes and direct_bytes must be positive, got {bucket_bytes}, {direct_bytes}")
    buckets: list[Bucket] = []
    entries: list[tuple[int, int]] = []
    end = 0
    for index, spec in enumerate(tensors):
        if spec.nbytes >= direct_bytes or spec.nbytes > bucket_bytes:
            if entries:
                buckets.append(Bucket(tuple(entries), end))
                entries, end = [], 0
            buckets.append(Bucket(((index, 0),), spec.nbytes))
            continue
        offset = _align(end)
        if entries and offset + spec.nbytes > bucket_bytes:
            buckets.append(Bucket(tuple(entries), end))
            entries, offset = [], 0
        entries.append((index, offset))
        end = offset + spec.nbytes
    if entries:
        buckets.append(Bucket(tuple(entries), end))
    return buckets


def _align(offset: int) -> int:
    return (offset + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def tensor_view(buffer: torch.Tensor, offset: int, spec: TensorSpec) -> torch.Tensor:
    """The tensor `spec` describes, as a view of a bucket's bytes at `offset` (no copy)."""
    return buffer[offset : offset + spec.nbytes].view(spec.dtype).view(spec.shape)


def bucket_views(
    buffer: torch.Tensor, specs: tuple[TensorSpec, ...], bucket: Bucket
) -> Iterator[tuple[str, torch.Tensor]]:
    for index, offset in bucket.entries:
        spec = specs[index]
        yield spec.name, tensor_view(buffer, offset, spec)
