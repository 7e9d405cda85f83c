"""Weights to SGLang servers through a shared folder (`--weight-transport disk`; slime's `--update-weight-transport
disk`): each push a checkpoint the server reloads in place with `/update_weights_from_disk`.

For servers the learner cannot form a broadcast group with (another cluster, another vendor's GPUs), as slime's full
disk sync does. The store protocol is the other SGLang mechanisms' (`weights.py`, `weight_store.py`): manifest, ready,
go, a word per bucket, acknowledgement, the servers' checksums for the weight check. What differs is the bucket: the
learner writes it as one safetensors file of the version's folder (`engines.weights.disk_files`, checkpoint names,
the push dtype) and says "bucket i"; after the last it writes the index, calls the post-write hook, and says the last
word. Each loader waits for every word, then makes one `/update_weights_from_disk` call with the folder (or its
local copy) and the version, and acknowledges. The server loads a push whole, so every push is full: SGLang's
endpoint cannot apply our deltas (slime's delta disk sync needs its patched SGLang's `/pull_weights`).

No weight-update session is opened: SGLang's disk reload runs its own post-load processing, which a session's end
would run a second time.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from engines.sglang import weight_store
from engines.sglang.client import SglangError
from engines.sglang.store_sender import DEFAULT_BUCKET_BYTES, SglangStoreSender
from engines.sglang.weight_store import ABORT_PREFIX, GO, SglangGroupSpec
from engines.sglang.weights import SglangWeightLoader
from engines.weights import disk_files
from engines.weights.base import TransferReport, WeightTransferError, require_usable
from engines.weights.disk import shared_directory
from engines.weights.disk_files import PostWrite, VersionWriter
from engines.weights.manifest import Manifest
from engines.weights.names import SGLANG_DISK


class SglangDiskSender(SglangStoreSender):
    """The learner's end: hosts the store, writes each push into `directory` and removes it after (unless
    `keep_files`); `post_write(version_dir, engines)` runs once the files are written, before any server reads."""

    def __init__(self, *, directory: str | os.PathLike[str], host: str = "127.0.0.1", gpus_per_engine: int = 1,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 120.0, keep_files: bool = False,
                 local_directory: str | None = None, post_write: PostWrite | None = None) -> None:
        super().__init__(host=host, gpus_per_engine=gpus_per_engine, bucket_bytes=bucket_bytes, timeout_s=timeout_s)
        self.directory = shared_directory(directory)
        self.keep_files, self.local_directory, self.post_write = keep_files, local_directory, post_write
        self._tcp_store: dist.TCPStore | None = None
        self._writer: VersionWriter | None = None
        self._published = b""

    def open_group(self, members: Sequence[str]) -> SglangGroupSpec:
        members = self._checked(members)
        self.close_group()
        self._tcp_store = dist.TCPStore(self.host, 0, is_master=True, wait_for_workers=False,
                                        timeout=timedelta(seconds=self.timeout_s))
        return self._new_spec(members, self._tcp_store.port, backend="none", transport=SGLANG_DISK,
                              directory=self.directory, local_directory=self.local_directory)

    def wait_for_receivers(self, timeout_s: float | None = None) -> None:
        """Nothing to join: the servers are reached through their rollout workers' HTTP calls."""
        require_usable(self._tcp_store, None, "weight store")

    def _store(self) -> dist.Store | None:
        return self._tcp_store

    def send(self, named_tensors: Iterable[tuple[str, Tensor]], version: int, *, dtype: torch.dtype | None = None,
             timeout_s: float | None = None, fingerprint: bool = False) -> TransferReport:
        """As every SGLang mechanism's `send`; the version's folder goes afterwards, whatever happened, unless kept."""
        try:
            return super().send(named_tensors, version, dtype=dtype, timeout_s=timeout_s, fingerprint=fingerprint)
        finally:
            self._writer = None
            if not self.keep_files:
                disk_files.remove(disk_files.version_dir(self.directory, version))

    def _transfer_begins(self, manifest: Manifest) -> None:
        self._published = manifest.encode()
        self._writer = VersionWriter(self.directory, manifest.version, len(manifest.buckets()))

    def _deliver_bucket(self, keys: dist.Store, spec: SglangGroupSpec, dtype: torch.dtype | None, timeout_s: float,
                        position: int, pairs: list[tuple[str, Tensor]], where: str) -> None:
        writer = self._writer
        assert writer is not None
        named = [(name, tensor.detach().to(device="cpu", dtype=dtype if dtype is not None and
                                           tensor.is_floating_point() else tensor.dtype)) for name, tensor in pairs]
        self._fingerprint_sent(named)
        try:
            writer.write(position, named)
            if position == writer.buckets - 1:
                writer.finish(self._published, spec.receivers, self.post_write)
        except RuntimeError as error:  # the learner's side: no server is to blame, and none waits for the word
            keys.set(f"bucket/{position}", ABORT_PREFIX + f" {error}".encode()[:500])
            raise WeightTransferError(f"{where}: {error}") from error
        keys.set(f"bucket/{position}", GO)

    def close_group(self) -> None:
        self._tcp_store, self._spec = None, None  # the store's server stops with its last reference

    def close(self) -> None:
        self.close_group()


class SglangDiskLoader(SglangWeightLoader):
    """A rollout worker's end: once every file of a push is written, its server reloads the folder in one call."""

    sessions = False

    async def _join(self, spec: SglangGroupSpec, timeout_s: float) -> None:
        if spec.directory is None:
            raise WeightTransferError(f"{self.engine_name}: group {spec.group_name} is a disk group without a folder")

    async def _forget_group(self, timeout_s: float) -> None:
        """No group lives on the server: nothing to free after a failed transfer."""

    async def _load_buckets(self, keys: dist.PrefixStore, manifest: Manifest, spec: SglangGroupSpec, version: int,
                            timeout_s: float) -> str | None:
        assert spec.directory is not None
        buckets = manifest.buckets()
        for position in range(len(buckets)):
            word = await asyncio.to_thread(weight_store.wait_bucket, keys, position, timeout_s)
            if word != GO:
                return f"bucket {position + 1}/{len(buckets)} not written: {word.decode(errors='replace')}"[:500]
        try:
            folder = await asyncio.to_thread(disk_files.localize, disk_files.version_dir(spec.directory, version),
                                             spec.local_directory, self.engine_name)
            await self.engine.update_weights_from_disk(model_path=str(folder), weight_version=str(version),
                                                       timeout=timeout_s + 10)
        except (SglangError, ValueError) as error:
            return str(error)[:500]
        return None
