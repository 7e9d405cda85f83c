"""Weights to SGLang servers through a shared folder (`--weight-transport disk`; slime's `--update-weight-transport
disk`): each push a checkpoint the server reloads in place with `/update_weights_from_disk`.

For servers the learner cannot form a broadcast group with (another cluster, another vendor's GPUs), as slime's full
disk sync does. The store protocol is the other SGLang mechanisms' (`weights.py`, `weight_store.py`): manifest, ready,
go, a word per bucket, acknowledgement, the servers' checksums for the weight check. What differs is the bucket: the
learner writes it as one safetensors file of the version's folder (`engines.weights.disk_files`, checkpoint names,
the push dtype) and says "bucket i"; after the last it writes the index, calls the post-write hook, and says the last
word. Each loader waits for every word, then makes one `/update_weights_from_disk` call with the folder (or its
local copy) and the version, and acknowledges.

Delta pushes (`--weight-delta-sync`, slime's `--update-weight-mode delta` with disk transport): SGLang has no endpoint
that applies part of a tensor, so, as slime does, the delta goes to a checkpoint the rollout worker keeps on its own
disk (`--weight-disk-local-dir`) rather than to the server. The learner keeps a copy of what it last pushed
(`held.SenderCopy`) and writes each tensor's changed elements only (`delta.py`), with its prints of the new version;
the loader writes them into its local checkpoint in place and checks every tensor of it against those prints
(`local_checkpoint.py`), and only then asks its server to reload that folder. The server's own checksum then goes
to the weight check as after any push. A full push (the first, every `anchor_every` versions, after any failure)
replaces the local checkpoint whole.

No weight-update session is opened: SGLang's disk reload runs its own post-load processing, which a session's end
would run a second time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Iterable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from engines.sglang import weight_store
from engines.sglang.client import SglangEngine, SglangError
from engines.sglang.store_sender import DEFAULT_BUCKET_BYTES, SglangStoreSender
from engines.sglang.weight_store import ABORT_PREFIX, GO, SglangGroupSpec
from engines.sglang.weights import SglangWeightLoader
from engines.weights import disk_files
from engines.weights.base import TransferReport, WeightTransferError, require_usable
from engines.weights.disk import shared_directory
from engines.weights.disk_files import PostWrite, VersionWriter
from engines.weights.fingerprint import Fingerprints, algorithm_for
from engines.weights.held import DEFAULT_ANCHOR_EVERY, DEFAULT_BACKOFF, SenderCopy
from engines.weights.local_checkpoint import LocalCheckpoint, expected_prints
from engines.weights.manifest import Manifest, TensorSpec
from engines.weights.names import SGLANG_DISK
from engines.weights.stream import SpecifiedTensors


class SglangDiskSender(SglangStoreSender):
    """The learner's end: hosts the store, writes each push into `directory` and removes it after (unless
    `keep_files`); `post_write(version_dir, engines)` runs once the files are written, before any server reads.
    `delta_sync`: after a full push, a push writes only what changed (the loaders need `local_directory`)."""

    def __init__(self, *, directory: str | os.PathLike[str], host: str = "127.0.0.1", gpus_per_engine: int = 1,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 120.0, keep_files: bool = False,
                 local_directory: str | None = None, post_write: PostWrite | None = None, delta_sync: bool = False,
                 anchor_every: int = DEFAULT_ANCHOR_EVERY, delta_backoff: int = DEFAULT_BACKOFF) -> None:
        super().__init__(host=host, gpus_per_engine=gpus_per_engine, bucket_bytes=bucket_bytes, timeout_s=timeout_s)
        if delta_sync and local_directory is None:
            raise ValueError("delta pushes to SGLang servers through a folder need a local folder on each engine's "
                             "host (--weight-disk-local-dir): the checkpoint each server reloads, patched there")
        self.directory = shared_directory(directory)
        self.keep_files, self.local_directory, self.post_write = keep_files, local_directory, post_write
        self.delta_sync = delta_sync  # public and changeable between pushes, as the torch senders'
        self._copy = SenderCopy(torch.device("cpu"), anchor_every=anchor_every, backoff=delta_backoff)
        self._tcp_store: dist.TCPStore | None = None
        self._writer: VersionWriter | None = None
        self._published = b""
        self._holding: dict[str, TensorSpec] = {}  # a full push's tensors to keep for later deltas, by name
        self._prints = b""  # a delta's: the learner's prints of every tensor of the new version (`PRINTS`)
        self._why_full: str | None = None  # under delta sync, why the push under way is full
        self._pushed: tuple[TensorSpec, ...] = ()  # the push under way's tensors as they travel whole

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
        """As every SGLang mechanism's `send`; the version's folder goes afterwards, whatever happened, unless kept.
        Under delta sync, a push that does not commit leaves the local checkpoints unknown: the next one is full."""
        self._why_full = None
        try:
            with self._copy.pushing(version, self.delta_sync, checked_by="checksums"):
                report = super().send(named_tensors, version, dtype=dtype, timeout_s=timeout_s,
                                      fingerprint=fingerprint)
        finally:
            self._writer, self._holding, self._prints = None, {}, b""
            if not self.keep_files:
                disk_files.remove(disk_files.version_dir(self.directory, version))
        if not self.delta_sync:
            return report
        assert self._spec is not None
        self._copy.committed(version, self._pushed, self._spec.generation, was_delta=report.delta_base is not None,
                             seconds=report.seconds, full_bytes=sum(spec.nbytes for spec in self._pushed))
        return dataclasses.replace(report, full_because=self._why_full)

    def _plan(self, manifest: Manifest, tensors: SpecifiedTensors) -> tuple[Manifest, Iterable[tuple[str, Tensor]]]:
        """Under delta sync: a delta against the version the local checkpoints hold where `SenderCopy` allows, its
        changed elements diffed now (the manifest says each tensor's encoding and count); else full, and kept."""
        self._pushed = manifest.tensors
        if not self.delta_sync:
            return manifest, tensors
        assert self._spec is not None
        manifest = dataclasses.replace(manifest, keep=self._copy.keeps())
        base, why_full = self._copy.base_for(manifest.tensors, self._spec.generation)
        if base is None:
            self._why_full = why_full
            self._holding = {spec.name: spec for spec in manifest.tensors} if manifest.keep else {}
            return manifest, tensors
        algorithm = self._sent.algorithm if self._sent is not None else algorithm_for("cpu")
        prints = self._sent if self._sent is not None else Fingerprints(algorithm)
        names = frozenset(spec.name for spec in manifest.tensors)
        changes, payloads = self._copy.diff(manifest.tensors, tensors, prints, names)
        self._prints = expected_prints(algorithm, prints.values())
        return dataclasses.replace(manifest, base_version=base, changes=changes), payloads

    def _transfer_begins(self, manifest: Manifest) -> None:
        self._published = manifest.encode()
        self._writer = VersionWriter(self.directory, manifest.version, len(manifest.wire().buckets()))

    def _deliver_bucket(self, keys: dist.Store, spec: SglangGroupSpec, dtype: torch.dtype | None, timeout_s: float,
                        position: int, pairs: list[tuple[str, Tensor]], where: str) -> None:
        writer = self._writer
        assert writer is not None
        is_delta = bool(self._prints)
        named = [(name, tensor.detach().to(device="cpu", dtype=dtype if dtype is not None and
                                           tensor.is_floating_point() else tensor.dtype)) for name, tensor in pairs]
        if not is_delta:  # a delta's tensors were fingerprinted as they were diffed
            self._fingerprint_sent(named)
        for name, tensor in named:
            if name in self._holding:
                self._copy.hold(self._holding[name], tensor)
        try:
            writer.write(position, named, delta=is_delta)
            if position == writer.buckets - 1:
                writer.finish(self._published, spec.receivers, self.post_write,
                              {disk_files.PRINTS: self._prints} if is_delta else None)
        except RuntimeError as error:  # the learner's side: no server is to blame, and none waits for the word
            keys.set(f"bucket/{position}", ABORT_PREFIX + f" {error}".encode()[:500])
            raise WeightTransferError(f"{where}: {error}") from error
        keys.set(f"bucket/{position}", GO)

    def close_group(self) -> None:
        self._tcp_store, self._spec = None, None  # the store's server stops with its last reference

    def close(self) -> None:
        self.close_group()


class SglangDiskLoader(SglangWeightLoader):
    """A rollout worker's end: once every file of a push is written, its server reloads the folder in one call (a
    delta's: the local checkpoint, once the delta is written into it and checked)."""

    sessions = False

    def __init__(self, engine: SglangEngine, engine_name: str, *, log: Any = None) -> None:
        super().__init__(engine, engine_name, log=log)
        self._local: LocalCheckpoint | None = None  # the checkpoint kept under delta sync, and its version

    async def _join(self, spec: SglangGroupSpec, timeout_s: float) -> None:
        if spec.directory is None:
            raise WeightTransferError(f"{self.engine_name}: group {spec.group_name} is a disk group without a folder")

    async def _forget_group(self, timeout_s: float) -> None:
        """No group lives on the server: nothing to free after a failed transfer."""

    async def _load_buckets(self, keys: dist.PrefixStore, manifest: Manifest, spec: SglangGroupSpec, version: int,
                            timeout_s: float) -> str | None:
        assert spec.directory is not None
        buckets = manifest.wire().buckets()
        for position in range(len(buckets)):
            word = await asyncio.to_thread(weight_store.wait_bucket, keys, position, timeout_s)
            if word != GO:
                return f"bucket {position + 1}/{len(buckets)} not written: {word.decode(errors='replace')}"[:500]
        try:
            folder = await asyncio.to_thread(self._folder, manifest, spec, version)
            await self.engine.update_weights_from_disk(model_path=str(folder), weight_version=str(version),
                                                       timeout=timeout_s + 10)
        except (SglangError, ValueError) as error:
            return str(error)[:500]
        return None

    def _folder(self, manifest: Manifest, spec: SglangGroupSpec, version: int) -> Path:
        """The folder the server reloads: the published one, its local copy, or (a delta) the local checkpoint once
        patched and checked. A ValueError says why there is none."""
        assert spec.directory is not None
        published = disk_files.version_dir(spec.directory, version)
        if spec.local_directory is None:
            if manifest.is_delta:
                raise ValueError(f"a delta push to {self.engine_name}, which keeps no local checkpoint to write it "
                                 "into (no --weight-disk-local-dir)")
            return published
        local = self._local_checkpoint(spec.local_directory)
        if manifest.is_delta:
            return local.patch(published, manifest)
        if manifest.keep:
            return local.replace(published, spec.local_directory, self.engine_name, version)
        local.version = None
        return disk_files.localize(published, spec.local_directory, self.engine_name)

    def _local_checkpoint(self, local_root: str) -> LocalCheckpoint:
        root = disk_files.local_dir(local_root, self.engine_name)
        if self._local is None or self._local.root != root:
            self._local = LocalCheckpoint(root)
        return self._local
