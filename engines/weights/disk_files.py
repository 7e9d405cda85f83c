"""The on-disk form of one push, shared by the disk transports (`disk.py` for torch engines, SGLang's in
`engines/sglang/disk_weights.py`): where a version's files go, how they are written and read, and when they go.

Why disk at all: a learner and engines that cannot form a torch.distributed group (NCCL across clusters, vendors or
data centres; a firewall that lets only a shared filesystem through) can still share a directory. slime calls it
`--update-weight-transport disk`. The coordination (manifest, ready, acknowledgement, the weight check) still travels
through the learner's store as for every mechanism; only the bytes go through the directory.

A push of version N is the folder `DIR/weight_v{N:06d}/` (slime's name), one safetensors file per bucket of the
push's plan (`model-00001-of-00003.safetensors`, ...) holding the bucket's tensors under our weight names, in the
dtype they are pushed in, plus `model.safetensors.index.json` (name -> file, as a Hugging Face checkpoint's) and the
push's manifest (`slipstream-manifest.json`). A full push to SGLang servers is therefore a checkpoint its
`/update_weights_from_disk` reads as is. A delta push (`held.py`) stores each tensor's encoded bytes (uint8) under its
name instead; the manifest says each encoding, and only our own loaders read those (an SGLang server's rollout worker
writes them into its local copy of the checkpoint, `local_checkpoint.py`, whose check reads the learner's prints of
the new version from `slipstream-prints.json`).

Each file is written under a temporary name and renamed, so a reader never sees half a file; after the last one the
learner calls the post-write hook (slime's `--custom-update-weight-post-write-path`: a filesystem without cross-host
read-after-write consistency publishes the files there) and only then tells the engines to read. The folder is removed
once the push is over (committed or not), unless the run keeps them (`--weight-disk-keep-files`).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from engines.weights.manifest import TensorSpec

INDEX = "model.safetensors.index.json"
MANIFEST = "slipstream-manifest.json"
PRINTS = "slipstream-prints.json"
PostWrite = Callable[[str, tuple[str, ...]], None]
"""Called with a version's folder and the receiving engines' names once every file of the push is written, before
any engine reads; what it raises fails the push."""


def version_dir(directory: str | os.PathLike[str], version: int) -> Path:
    return Path(directory) / f"weight_v{version:06d}"


def shard_name(position: int, total: int) -> str:
    return f"model-{position + 1:05d}-of-{total:05d}.safetensors"


class VersionWriter:
    """Writes one push's files into `directory/weight_vNNNNNN`, bucket by bucket; `finish` completes the folder."""

    def __init__(self, directory: str | os.PathLike[str], version: int, buckets: int) -> None:
        self.path = version_dir(directory, version)
        self.version, self.buckets = version, buckets
        self._weight_map: dict[str, str] = {}
        try:
            shutil.rmtree(self.path, ignore_errors=True)  # a folder of an earlier, failed push of this version
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise RuntimeError(f"weight disk: cannot create {self.path}: {error}") from error

    def write(self, position: int, named: Iterable[tuple[str, Tensor]], *, delta: bool = False) -> None:
        """Bucket `position`'s tensors as one safetensors file (copied to the CPU, contiguous, as given)."""
        name = shard_name(position, self.buckets)
        tensors = {tensor_name: tensor.detach().to("cpu").contiguous() for tensor_name, tensor in named}
        metadata = {"format": "pt", "slipstream_version": str(self.version), "slipstream_delta": str(int(delta))}
        temporary = self.path / f".{name}.tmp"
        try:
            save_file(tensors, str(temporary), metadata=metadata)
            os.replace(temporary, self.path / name)
        except (OSError, ValueError, RuntimeError) as error:
            raise RuntimeError(f"weight disk: cannot write {self.path / name}: {error}") from error
        self._weight_map.update(dict.fromkeys(tensors, name))

    def finish(self, manifest: bytes, receivers: Sequence[str], post_write: PostWrite | None,
               extras: Mapping[str, bytes] | None = None) -> None:
        """The index, the manifest and `extras` (file name -> bytes), then the post-write hook: after this the
        engines may read."""
        index = {"metadata": {"slipstream_version": self.version}, "weight_map": self._weight_map}
        try:
            _write_atomically(self.path / INDEX, json.dumps(index).encode())
            _write_atomically(self.path / MANIFEST, manifest)
            for name, data in (extras or {}).items():
                _write_atomically(self.path / name, data)
        except OSError as error:
            raise RuntimeError(f"weight disk: cannot write the index of {self.path}: {error}") from error
        if post_write is not None:
            try:
                post_write(str(self.path), tuple(receivers))
            except Exception as error:
                raise RuntimeError(f"weight disk: the post-write hook failed on {self.path}: "
                                   f"{type(error).__name__}: {error}") from error


def read_bucket(folder: str | os.PathLike[str], position: int, total: int,
                specs: Sequence[TensorSpec]) -> list[tuple[str, Tensor]]:
    """Bucket `position`'s tensors, in `specs` order, checked against them; a file that is missing or holds anything
    else is a ValueError naming the file and the tensor."""
    path = Path(folder) / shard_name(position, total)
    if not path.is_file():
        raise ValueError(f"weight disk: {path} is missing (the learner's folder is not visible here, or was removed)")
    with safe_open(str(path), framework="pt") as handle:
        present = set(handle.keys())
        wanted = [spec.name for spec in specs]
        if present != set(wanted):
            raise ValueError(f"weight disk: {path} holds {sorted(present - set(wanted))[:3]} and lacks "
                             f"{sorted(set(wanted) - present)[:3]} (expected the manifest's bucket {position + 1})")
        named = []
        for spec in specs:
            tensor = handle.get_tensor(spec.name)
            if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
                raise ValueError(f"weight disk: {path}: {spec.name!r} is {tensor.dtype} {list(tensor.shape)}, the "
                                 f"manifest says {spec.dtype} {list(spec.shape)}")
            named.append((spec.name, tensor))
    return named


def localize(folder: str | os.PathLike[str], local_root: str | os.PathLike[str] | None, engine: str) -> Path:
    """Where an engine reads a version from: the published folder itself, or (with `local_root`, slime's
    `--update-weight-local-checkpoint-dir`) a copy of it in `local_root/<engine>/`, on the engine's own disk, which
    replaces the previous version's copy there."""
    source = Path(folder)
    if local_root is None:
        return source
    target = local_dir(local_root, engine)
    try:
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(source, target)
    except OSError as error:
        raise ValueError(f"weight disk: cannot copy {source} to the local folder {target}: {error}") from error
    return target


def local_dir(local_root: str | os.PathLike[str], engine: str) -> Path:
    """Where `engine` keeps its copy under `local_root`."""
    return Path(local_root) / engine.replace("/", "_")


def remove(folder: str | os.PathLike[str]) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def _write_atomically(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)
