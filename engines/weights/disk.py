"""Weight pushes to torch engines through a shared folder (`--weight-transport disk`; slime's
`--update-weight-transport disk`): the protocol of `torch_distributed.py` with files in place of the broadcast.

Everything but the bytes is the broadcast's: the learner hosts the rendezvous store, publishes the manifest, waits
for every engine's "ready", says "go", collects the acknowledgements and the engines' fingerprints, commits only
when they agree, and repairs a failed or mismatched push with a full one; delta sync (`held.py`) works unchanged,
its encoded bytes written instead of broadcast. So a push through the folder leaves every engine bit for bit where a
push over gloo would. What differs: after "go" the learner writes the push into `DIR/weight_vNNNNNN/`
(`disk_files.py`: one safetensors file per bucket, under our weight names), calls the post-write hook, and says
"written"; each engine then reads the files (from its own local copy with a local folder) and loads them through
the same load path, in place where a delta allows. No process group is formed: the learner and the engines need a
folder they both see and the store's TCP port, nothing else.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from itertools import islice
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from engines.weights import disk_files
from engines.weights import group as groups
from engines.weights.base import TransferReport
from engines.weights.disk_files import PostWrite, VersionWriter
from engines.weights.fingerprint import Fingerprints
from engines.weights.held import SenderCopy
from engines.weights.manifest import Bucket, Manifest
from engines.weights.names import DISK
from engines.weights.torch_distributed import TorchDistributedWeightSender
from engines.weights.torch_receiver import TorchDistributedWeightReceiver

WRITTEN = "written"  # per transfer: set once every file is written and the post-write hook returned


class _Folder:
    """Where a process group stands in the broadcast's protocol: nothing to form, nothing to release."""

    def __repr__(self) -> str:
        return "the shared weight folder"


FOLDER: Any = _Folder()


def shared_directory(directory: str | os.PathLike[str]) -> str:
    """The folder as every member names it (absolute: slime's rule is that the learner and the engines see the
    same path), created if missing; a folder that cannot be made is an error naming it."""
    path = Path(directory).expanduser().absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"weight disk folder {str(directory)!r}: cannot be created: {error}") from error
    return str(path)


class DiskWeightSender(TorchDistributedWeightSender):
    """Learner rank 0's end: writes each push into `directory` and removes it once the push is over (unless
    `keep_files`); `post_write(version_dir, engines)` runs after the files are written, before any engine reads."""

    def __init__(self, *, directory: str | os.PathLike[str], keep_files: bool = False,
                 post_write: PostWrite | None = None, local_directory: str | None = None, **options: Any) -> None:
        super().__init__(backend="disk", transport=DISK, **options)
        self.directory = shared_directory(directory)
        self.keep_files, self.post_write, self.local_directory = keep_files, post_write, local_directory

    def _spec_extras(self) -> dict[str, Any]:
        return {"directory": self.directory, "local_directory": self.local_directory}

    def _form_group(self, spec: groups.GroupSpec, keys: dist.PrefixStore) -> None:
        self._group = FOLDER

    def send(self, named_tensors: Iterable[tuple[str, Tensor]], version: int, *, dtype: torch.dtype | None = None,
             timeout_s: float | None = None, fingerprint: bool = False) -> TransferReport:
        """As the broadcast's `send`; the version's folder goes afterwards, whatever happened, unless kept."""
        try:
            return super().send(named_tensors, version, dtype=dtype, timeout_s=timeout_s, fingerprint=fingerprint)
        finally:
            if not self.keep_files:
                disk_files.remove(disk_files.version_dir(self.directory, version))

    def _broadcast_buckets(self, stream: Iterator[tuple[str, Tensor]], manifest: Manifest,
                           buckets: list[Bucket], sent: Fingerprints | None = None,
                           covered: frozenset[str] = frozenset(), keep: SenderCopy | None = None) -> bool:
        """Write every bucket (`manifest` is the wire's), fingerprinting and keeping tensors as the broadcast does,
        then the index, the hook and "written". False if `abort()` came first; a write that fails raises
        RuntimeError, which the protocol reports as a broken transfer (the engines' acks carry the reason)."""
        assert self._keys is not None and self._spec is not None
        prefix = f"xfer/{self._sequence}/"
        published = self._keys.get(prefix + "manifest")  # the whole manifest: a delta's encodings too
        is_delta = Manifest.decode(published).is_delta
        writer = VersionWriter(self.directory, manifest.version, len(buckets))
        for position, bucket in enumerate(buckets):
            if self._aborted is not None:
                return False
            pulled = [tensor for _, tensor in islice(stream, len(bucket.entries))]
            named = []
            for (index, _), tensor in zip(bucket.entries, pulled, strict=True):
                spec = manifest.tensors[index]
                if keep is not None:
                    keep.hold(spec, tensor)
                wire = tensor.detach().to(device="cpu", dtype=spec.dtype)
                if sent is not None and spec.name in covered:
                    sent.add(spec.name, wire)
                named.append((spec.name, wire))
            del pulled
            writer.write(position, named, delta=is_delta)
        next(stream, None)  # past the last spec: raises SourceBroke if the source has more
        writer.finish(published, self._spec.receivers, self.post_write)
        self._keys.set(prefix + WRITTEN, groups.OK)
        return True


class DiskWeightReceiver(TorchDistributedWeightReceiver):
    """An engine's end: joins a generation without a process group, and reads each push from the folder."""

    @classmethod
    def _form_group(cls, spec: groups.GroupSpec, name: str, rank: int, keys: dist.PrefixStore,
                    transfer_device: torch.device, timeout_s: float) -> Any:
        if spec.directory is None:
            raise ValueError(f"{name}: generation {spec.generation} is a disk group without a directory")
        return FOLDER

    def _receive_buckets(self, manifest: Manifest, load_fn: Any, destinations: Mapping[str, Tensor]) -> str | None:
        """Wait for "written", then load each bucket's file in turn; load_fn's (or a bad file's) error, or None.
        Files are never read straight into the engine's tensors (`destinations`): a read is a copy anyway."""
        assert self.spec.directory is not None
        prefix = f"xfer/{self._sequence}/"
        deadline_s = groups.collective_timeout_s(self._timeout_s)  # as long as a broadcast may take
        if groups.missing_keys(self._keys, [prefix + WRITTEN], deadline_s, stop=self._given_up):
            if self._given_up():
                self._group = None  # the protocol acknowledges "left" and raises the sender's reason
                return None
            raise RuntimeError(f"the learner wrote no files for version {manifest.version} within {deadline_s:g}s")
        try:
            folder = disk_files.localize(disk_files.version_dir(self.spec.directory, manifest.version),
                                         self.spec.local_directory, self.name)
            buckets = manifest.buckets()
            for position, bucket in enumerate(buckets):
                specs = [manifest.tensors[index] for index, _ in bucket.entries]
                load_fn(disk_files.read_bucket(folder, position, len(buckets), specs))
        except Exception as error:  # a missing or wrong file fails this engine's load, as a load_fn error does
            return f"{type(error).__name__}: {error}"
        return None
