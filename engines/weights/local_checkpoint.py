"""The checkpoint an engine host keeps of what its server serves, patched by delta pushes in place and verified.

An SGLang server takes weights whole: neither pinned release has an endpoint that applies part of a tensor
(`/update_weights_from_disk` reloads a folder; its request's `manifest` field is read by nothing). So a delta push
to SGLang servers goes through the shared folder as slime's disk deltas do: each rollout worker keeps, on its own
disk (`--weight-disk-local-dir`), a copy of the checkpoint its server last reloaded; a full push replaces that copy
(`disk_files.localize`), a delta push is written into it here, and the server reloads the patched folder through the
ordinary endpoint.

A delta's files hold each tensor's encoded bytes (`delta.py`) under its name, bucketed as any push; the local copy
keeps the full push's files. Each changed tensor is overwritten in place through a memory map of its file (the
safetensors layout: an 8-byte header length, a JSON header of byte ranges, then the raw bytes), so only the bytes
of changed elements are written and no second copy of a shard is ever made. Then every tensor of the copy is
fingerprinted as it now lies on disk and compared with the learner's prints of the new version (`PRINTS` in the
delta's folder): a copy that was damaged since the last push (a disk error, a stray writer) differs, the patch is
refused before the server reloads anything, and the push fails, so the next one is full and replaces the copy.

While a patch runs the copy's version is unknown: a patch cut off half-way leaves it unknown, and any delta
against it is refused until a full push replaces it.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from engines.weights import delta, disk_files
from engines.weights.fingerprint import Fingerprints, mismatched, some
from engines.weights.manifest import Manifest, TensorSpec

# safetensors' dtype names (its format's, not torch's)
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


def expected_prints(algorithm: str, prints: Mapping[str, int]) -> bytes:
    """The learner's fingerprints of every tensor of the version a delta makes, as `PRINTS` holds them."""
    return json.dumps({"algorithm": algorithm, "prints": dict(prints)}, separators=(",", ":")).encode()


class LocalCheckpoint:
    """The folder `root` and the version it holds (None: unknown, so no delta can apply to it)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.version: int | None = None

    def replace(self, published: str | os.PathLike[str], local_root: str | os.PathLike[str], engine: str,
                version: int) -> Path:
        """A full push: the published folder copied over the local one, which then holds `version`."""
        self.version = None
        folder = disk_files.localize(published, local_root, engine)
        self.version = version
        return folder

    def patch(self, published: str | os.PathLike[str], manifest: Manifest) -> Path:
        """A delta push (`manifest` is its whole manifest, `published` its folder) written into the copy, verified
        against the learner's prints; a ValueError says what is wrong (the copy then holds no known version)."""
        if self.version != manifest.base_version:
            held = "no known version" if self.version is None else f"version {self.version}"
            raise ValueError(f"a delta against version {manifest.base_version}, but the local checkpoint {self.root} "
                             f"holds {held}; the next push is full")
        self.version = None
        algorithm, expected = _read_prints(Path(published))
        payloads = _read_payloads(Path(published), manifest)
        located = _locate(self.root, manifest.tensors)
        prints = Fingerprints(algorithm)
        for path, entries in located.items():
            changed = any(payloads[spec.name][1] for spec, _ in entries)
            # copy-on-write where nothing changes: the views stay writable, the file untouched
            memory = np.memmap(path, dtype=np.uint8, mode="r+" if changed else "c")
            try:
                for spec, (start, end) in entries:
                    encoding, count, payload = payloads[spec.name]
                    target = _tensor_at(memory, start, end, spec)
                    if count or encoding == delta.DENSE:
                        delta.apply(encoding, payload, count, target)
                        _write_back(memory, start, target)
                    prints.add(spec.name, target)
                if changed:
                    memory.flush()
            finally:
                del memory
        wrong = mismatched(expected, prints.values())
        if wrong:
            raise ValueError(f"the local checkpoint {self.root} patched to version {manifest.version} differs from "
                             f"the learner's weights in {len(wrong)} tensor(s), e.g. {some(wrong)} (damaged since "
                             "the last push?); the next push is full and replaces it")
        self.version = manifest.version
        return self.root


def _read_prints(folder: Path) -> tuple[str, dict[str, int]]:
    path = folder / disk_files.PRINTS
    try:
        raw = json.loads(path.read_bytes())
        algorithm, prints = raw["algorithm"], raw["prints"]
        if not isinstance(algorithm, str) or not all(isinstance(value, int) for value in prints.values()):
            raise TypeError("values of the wrong type")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"weight disk: {path}: the learner's prints of the delta are unreadable: {error}") from error
    return algorithm, prints


def _read_payloads(folder: Path, manifest: Manifest) -> dict[str, tuple[str, int, Tensor]]:
    """Each tensor's (encoding, changed count, encoded bytes) from the delta's files."""
    wire = manifest.wire()
    buckets = wire.buckets()
    payloads: dict[str, Tensor] = {}
    for position, bucket in enumerate(buckets):
        specs = [wire.tensors[index] for index, _ in bucket.entries]
        payloads.update(disk_files.read_bucket(folder, position, len(buckets), specs))
    return {spec.name: (encoding, count, payloads[spec.name])
            for spec, (encoding, count) in zip(manifest.tensors, manifest.changes, strict=True)}


def _locate(root: Path, specs: tuple[TensorSpec, ...]) -> dict[Path, list[tuple[TensorSpec, tuple[int, int]]]]:
    """Each file of the copy with its tensors' absolute byte ranges; the copy must hold exactly `specs`, each in its
    dtype and shape, else a ValueError names the first difference."""
    index = root / disk_files.INDEX
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"weight disk: the local checkpoint's index {index} is unreadable: {error}") from error
    wanted = {spec.name for spec in specs}
    if set(weight_map) != wanted:
        raise ValueError(f"weight disk: the local checkpoint {root} holds {sorted(set(weight_map) - wanted)[:3]} and "
                         f"lacks {sorted(wanted - set(weight_map))[:3]} of the delta's tensors")
    headers: dict[str, tuple[int, dict]] = {}
    located: dict[Path, list[tuple[TensorSpec, tuple[int, int]]]] = {}
    for spec in specs:
        file = weight_map[spec.name]
        if file not in headers:
            headers[file] = _header(root / file)
        data_start, header = headers[file]
        entry = header.get(spec.name)
        if not isinstance(entry, dict) or SAFETENSORS_DTYPES.get(entry.get("dtype")) != spec.dtype or tuple(
                entry.get("shape", ())) != spec.shape:
            raise ValueError(f"weight disk: {root / file}: {spec.name!r} is not {spec.dtype} {list(spec.shape)} there "
                             f"({str(entry)[:80]})")
        begin, end = entry["data_offsets"]
        located.setdefault(root / file, []).append((spec, (data_start + begin, data_start + end)))
    return located


def _header(path: Path) -> tuple[int, dict]:
    """Where a safetensors file's data starts, and its header."""
    try:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            return 8 + length, json.loads(handle.read(length))
    except (OSError, ValueError, struct.error) as error:
        raise ValueError(f"weight disk: {path}: not a readable safetensors file: {error}") from error


def _tensor_at(memory: np.memmap, start: int, end: int, spec: TensorSpec) -> Tensor:
    """The tensor at bytes [start, end) of a mapped file: a view of the mapping where its elements are aligned
    (files safetensors writes order tensors so they are), else a copy that `_write_back` returns."""
    raw = torch.from_numpy(memory[start:end])
    if start % spec.dtype.itemsize:
        raw = raw.clone()
    return raw.view(spec.dtype).view(spec.shape)


def _write_back(memory: np.memmap, start: int, target: Tensor) -> None:
    """A patched copy's bytes into the mapping (a view of it was written already)."""
    flat = target.reshape(-1).view(torch.uint8)
    if flat.data_ptr() != memory[start:start + 1].ctypes.data:
        memory[start:start + flat.numel()] = flat.numpy()
