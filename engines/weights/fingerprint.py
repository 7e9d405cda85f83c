"""Fingerprints of pushed weights: does an engine serve exactly the bits the learner sent?

An acknowledged push says the bytes arrived, not that the engine serves them: a load that skipped a tensor, an
adapter never merged, a colocated hand-over that restored old weights all acknowledge. So both ends fingerprint
each tensor, the learner over what it sent and the engine over what it serves after the load, and the learner
compares (`mismatched`). A fingerprint is an exact function of a tensor's bits in the dtype it travelled in,
with its dtype and shape: an engine that keeps a wider copy (float32 weights fed bfloat16) casts back to the wire
dtype first, which is exact; one that keeps a narrower copy cannot be compared and says so.

Two algorithms, one per kind of device, so neither end copies weights to another device to fingerprint them:
- ``xxh3`` for CPU tensors: xxHash's XXH3-64 over the raw bytes, seeded with the XXH3-64 of the dtype and shape
  (`_header`), in one call per tensor (gigabytes per second, zero copy; the seed is cached per dtype and shape);
- ``wsum`` for CUDA tensors: the 16-bit words of the tensor weighted by a fixed pseudo-random sequence and summed
  modulo p = 2^31 - 1 in chunks of CHUNK_WORDS, the chunks' sums folded as h * M^k + sum_c s_c * M^(k-1-c) mod p
  (h: the CRC-32 of the header mod p, k chunks, M = _CHUNK_MIX). The device computes the sum over the chunks from
  the tensor alone, never waiting for the host; the host reads one number per tensor, all at once, and adds the
  header's term itself (`_fold`), so no host value is copied to the device per tensor.
Both are exact functions of the bytes (the sum is integer arithmetic, so its order does not matter), so the
learner and the engine agree bit for bit. Either runs on either device (slower there), so a learner and an
engine on different kinds of device still compare.

Reading every pushed byte once more on both ends costs about a tenth of a push where the push itself is a memory
copy (a CPU over gloo). So a push may fingerprint one of `stride` equal slices of rows of each tensor with more
rows than that (small tensors whole), slice `version % stride`: a contiguous view, read in place. A LoRA push is
hundreds of small factors, where the cost is per tensor (and the engine's check that each layer holds its merge),
so there a push covers one of every `stride` adapted layers instead (in name order, those at `version % stride`).
The failures that matter in practice (a tensor never loaded, an adapter never merged, old weights restored) change
nearly every row, or every layer, and are caught at the push they happen; `stride` consecutive pushes read every
row and every layer, so a corruption that stays is caught within `stride` pushes. Stride 1 reads every byte of
every push (`FingerprintPlan`).
"""

from __future__ import annotations

import functools
import json
import time
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch
from torch import Tensor

from engines.training.lora import WIRE_SUFFIXES

ALGORITHMS = ("xxh3", "wsum")
CHUNK_WORDS = 1 << 20  # 8 MiB of int64 at a time on the device
_MODULUS = (1 << 31) - 1
_CHUNK_MIX = 1_000_003
_weights_cache: dict[torch.device, Tensor] = {}


def algorithm_for(device: torch.device | str) -> str:
    """The algorithm that fingerprints tensors on `device` without moving them."""
    return "wsum" if torch.device(device).type == "cuda" else "xxh3"


def comparable_dtype(wire: torch.dtype, served: torch.dtype) -> bool:
    """Whether an engine serving `served` can reproduce the `wire` bits: the same dtype, or a wider float."""
    if wire == served:
        return True
    if not (wire.is_floating_point and served.is_floating_point):
        return False
    wire_info, served_info = torch.finfo(wire), torch.finfo(served)
    return served_info.bits > wire_info.bits and served_info.eps <= wire_info.eps and served_info.max >= wire_info.max


class _Named(Protocol):
    @property
    def name(self) -> str: ...


Spec = TypeVar("Spec", bound=_Named)  # a manifest's `TensorSpec`: the manifest imports this module


@dataclass(frozen=True)
class FingerprintPlan:
    """What both ends of one push fingerprint: the algorithm, which tensors (`covered`) and which of their rows
    (slice `version % stride` of `stride` of each tensor with more than `stride` rows; see the module docstring)."""

    algorithm: str
    stride: int = 1
    version: int = 0

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"fingerprint algorithm: expected one of {ALGORITHMS}, got {self.algorithm!r}")
        if not isinstance(self.stride, int) or self.stride < 1:
            raise ValueError(f"fingerprint stride: expected an int >= 1, got {self.stride!r}")

    def prints(self) -> Fingerprints:
        return Fingerprints(self.algorithm, self.stride, self.version % self.stride)

    def covered(self, specs: Sequence[Spec]) -> tuple[Spec, ...]:
        """The tensors of a push both ends fingerprint: every full tensor, and the LoRA factors of this push's share
        of the adapted layers."""
        if self.stride == 1:
            return tuple(specs)
        layers = sorted({_adapted_layer(spec.name) for spec in specs} - {None})  # type: ignore[type-var]
        share = set(layers[self.version % self.stride::self.stride])
        return tuple(spec for spec in specs if _adapted_layer(spec.name) in share | {None})


def _adapted_layer(name: str) -> str | None:
    """`model.layers.0.mlp.up_proj` for its factor `model.layers.0.mlp.up_proj.lora_A.weight`; None for a weight."""
    return name.rsplit(".", 2)[0] if name.endswith(WIRE_SUFFIXES) else None


def sampled_rows(tensor: Tensor, stride: int, offset: int) -> Tensor:
    """Slice `offset` of `stride` near-equal slices of `tensor`'s rows (a view); a tensor of one dimension, or of
    no more than `stride` rows, whole."""
    rows = tensor.shape[0] if tensor.dim() >= 2 else 0
    if stride == 1 or rows <= stride:
        return tensor
    return tensor[offset * rows // stride:(offset + 1) * rows // stride]


class Fingerprints:
    """Fingerprints of named tensors, gathered one by one, read at the end: on a GPU, one host sync in all."""

    def __init__(self, algorithm: str, stride: int = 1, offset: int = 0) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"fingerprint algorithm: expected one of {ALGORITHMS}, got {algorithm!r}")
        self.algorithm, self.stride, self.offset = algorithm, stride, offset
        self.seconds = 0.0  # spent fingerprinting so far: what the check costs this end
        self._ready: dict[str, int] = {}
        self._on_device: dict[str, tuple[Tensor, int, int]] = {}  # name -> `_wsum`'s device sum, header, chunks

    def add(self, name: str, tensor: Tensor, dtype: torch.dtype | None = None) -> None:
        """Fingerprint `tensor` (its rows of this push) as `dtype` (default: its own) under `name`."""
        started = time.perf_counter()
        tensor = sampled_rows(tensor.detach(), self.stride, self.offset)
        if dtype is not None and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        if self.algorithm == "xxh3":
            self._ready[name] = _xxh3(tensor)
        else:
            self._on_device[name] = _wsum(tensor)
        self.seconds += time.perf_counter() - started

    def values(self) -> dict[str, int]:
        if self._on_device:
            started = time.perf_counter()
            names = list(self._on_device)
            read = torch.stack([self._on_device[name][0] for name in names]).tolist()  # the one host read
            self._ready.update((name, _fold(value, *self._on_device[name][1:]))
                               for name, value in zip(names, read, strict=True))
            self._on_device.clear()
            self.seconds += time.perf_counter() - started
        return dict(self._ready)


def fingerprint(tensor: Tensor, algorithm: str, dtype: torch.dtype | None = None) -> int:
    prints = Fingerprints(algorithm)
    prints.add("", tensor, dtype)
    return prints.values()[""]


def fingerprint_all(named: Iterable[tuple[str, Tensor]], algorithm: str) -> dict[str, int]:
    prints = Fingerprints(algorithm)
    for name, tensor in named:
        prints.add(name, tensor)
    return prints.values()


def mismatched(sent: Mapping[str, int], served: Mapping[str, int]) -> list[str]:
    """The names whose fingerprints differ, or that the engine did not fingerprint, in the order sent."""
    return [name for name, value in sent.items() if served.get(name) != value]


@dataclass
class ServedPrints:
    """An engine's answer after a load: the fingerprint of what it serves for each tensor it could fingerprint, and
    why not for the others (a narrower dtype than the wire's, a tensor it does not hold as sent)."""

    prints: dict[str, int] = field(default_factory=dict)
    unchecked: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0  # what fingerprinting took the engine (beside its generation, which resumed first)

    def encode(self) -> bytes:
        return json.dumps({"prints": self.prints, "unchecked": self.unchecked, "seconds": self.seconds},
                          separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> ServedPrints:
        try:
            raw = json.loads(data)
            prints, unchecked, seconds = raw["prints"], raw["unchecked"], raw.get("seconds", 0.0)
            if not (all(isinstance(v, int) for v in prints.values()) and all(isinstance(v, str) for v in
                                                                               unchecked.values())
                    and isinstance(seconds, int | float)):
                raise TypeError("values of the wrong type")
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"served fingerprints: unreadable ({error}): {data[:80]!r}") from error
        return cls(dict(prints), dict(unchecked), float(seconds))


@dataclass(frozen=True)
class FingerprintCheck:
    """One push's verdict, engine by engine: which engines serve exactly what was sent, which serve other bits
    (and in which tensors), and which could not be checked (and why).

    `why`: for an engine of `differ` whose difference shows only in a checksum of everything it serves (SGLang's,
    `engines/sglang/checksums.py`), what shows it; its `differ` entry then lists the tensors known to be involved,
    if any. `seconds`: what fingerprinting cost each end that says (the sender as "sender", each engine by name)."""

    algorithm: str
    matched: tuple[str, ...] = ()
    differ: dict[str, list[str]] = field(default_factory=dict)
    unchecked: dict[str, str] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict, compare=False)  # a measurement, not the verdict

    @property
    def ok(self) -> bool:
        return not self.differ

    def problems(self) -> dict[str, str]:
        """What is wrong with each engine that serves other bits, in a few words naming the tensors (or, where no
        tensor can be named, what shows the difference)."""
        return {engine: self.why.get(engine) or f"serves other bits in {some(names)}"
                for engine, names in self.differ.items()}

    def describe(self) -> str:
        parts = [f"{engine} {problem}" for engine, problem in self.problems().items()]
        parts += [f"{engine} unchecked: {why}" for engine, why in self.unchecked.items()]
        return "; ".join(parts) or f"{len(self.matched)} engine(s) serve exactly the weights sent"


def check_served(algorithm: str, sent: Mapping[str, int], served: Mapping[str, ServedPrints | str],
                 sender_seconds: float = 0.0) -> FingerprintCheck:
    """Compare what each engine serves (its `ServedPrints`, or why it sent none) with what was sent (which cost the
    sender `sender_seconds`)."""
    matched: list[str] = []
    differ: dict[str, list[str]] = {}
    unchecked: dict[str, str] = {}
    for engine, answer in served.items():
        if isinstance(answer, str):
            unchecked[engine] = answer
            continue
        wrong = [name for name in mismatched(sent, answer.prints) if name not in answer.unchecked]
        if wrong:
            differ[engine] = wrong
        elif answer.unchecked:
            unchecked[engine] = f"{len(answer.unchecked)} tensor(s) not comparable, e.g. " + some(
                [f"{name} ({why})" for name, why in answer.unchecked.items()])
        else:
            matched.append(engine)
    seconds = {"sender": sender_seconds} | {engine: answer.seconds for engine, answer in served.items()
                                            if not isinstance(answer, str)}
    return FingerprintCheck(algorithm, tuple(matched), differ, unchecked, seconds=seconds)


def some(names: list[str], shown: int = 3) -> str:
    """The first `shown` names, and how many more."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _header(tensor: Tensor) -> bytes:
    return f"{tensor.dtype}{tuple(tensor.shape)}".encode()


@functools.lru_cache(maxsize=4096)
def _xxh3_seed(header: bytes) -> int:
    import xxhash  # here: a GPU machine fingerprinting on the device needs only torch

    return xxhash.xxh3_64_intdigest(header)


def _xxh3(tensor: Tensor) -> int:
    import xxhash

    flat = tensor.contiguous().reshape(-1).view(torch.uint8)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    digest = xxhash.xxh3_64_intdigest(memoryview(flat.numpy()), _xxh3_seed(_header(tensor)))
    return digest & 0x7FFF_FFFF_FFFF_FFFF  # fits msgpack's int64, like wsum's


def _position_weights(device: torch.device) -> Tensor:
    """A fixed sequence of odd multipliers below 2^24 + 1: every 16-bit word at a position counts differently."""
    weights = _weights_cache.get(device)
    if weights is None:
        positions = torch.arange(CHUNK_WORDS, dtype=torch.int64, device=device)
        weights = _weights_cache[device] = (positions * 2654435761) % (1 << 24) | 1
    return weights


def _wsum(tensor: Tensor) -> tuple[Tensor, int, int]:
    """The device's part of the print (a scalar on the tensor's device: sum_c s_c * M^(k-1-c) mod p over its k
    chunks, each chunk's s_c = (words · weights) mod p), the header's CRC and k, for `_fold`. Words < 2^16 and
    weights < 2^24 + 1 keep every partial sum of a chunk below 2^61, so int64 never overflows."""
    header = zlib.crc32(_header(tensor)) % _MODULUS
    flat = tensor.contiguous().reshape(-1).view(torch.uint8)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    words = flat.view(torch.int16)
    weights = _position_weights(words.device)
    total = None
    chunks = 0
    for start in range(0, words.numel(), CHUNK_WORDS):
        chunk = words[start:start + CHUNK_WORDS].to(torch.int64).bitwise_and_(0xFFFF)
        partial = chunk.mul_(weights[:chunk.numel()]).sum().remainder_(_MODULUS)
        total = partial if total is None else (total * _CHUNK_MIX + partial).remainder_(_MODULUS)
        chunks += 1
    if total is None:  # no words: the header alone
        total = torch.zeros((), dtype=torch.int64, device=words.device)
    return total, header, chunks


def _fold(device_sum: int, header: int, chunks: int) -> int:
    """A `wsum` print from its parts: the header's term, h * M^k mod p, added on the host."""
    return (header * pow(_CHUNK_MIX, chunks, _MODULUS) + device_sum) % _MODULUS
