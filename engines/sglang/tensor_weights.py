"""Weights to colocated SGLang servers by reference: `/update_weights_from_tensor` instead of a broadcast.

A colocated server shares the learner's GPU (or, on CPUs, its host), where NCCL cannot form a group of two ranks
on one device and a broadcast would copy bytes the server can read in place. So each bucket travels as handles
to the learner's memory (`tensor_payload.py`): CUDA IPC on a GPU, named shared memory on a CPU. The rollout worker
relays them to its server in one `/update_weights_from_tensor` call per bucket and never opens them itself.

The store protocol is the broadcast path's (`weights.py`, `weight_store.py`): manifest, ready, go, a word per
bucket, acknowledgement; the store is the learner's own, with no process group behind it. What differs is the
bucket: the learner copies its tensors into a staging buffer it reuses (the next training step must not change
them while the server reads; shared memory made afresh per bucket would cost a page fault per page), writes one
payload per tensor-parallel rank of each server under `payload/i/engine/rank` (each opening takes over the
reference its own pickling took, so no payload is opened twice), says "bucket i", and reuses the buffer
only once every server said it loaded the bucket (`loaded/i/engine`), with a deadline. So one bucket is held
besides the model, as when broadcasting.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from engines.sglang import weight_store
from engines.sglang.client import SglangError
from engines.sglang.store_sender import DEFAULT_BUCKET_BYTES, SglangStoreSender
from engines.sglang.tensor_payload import encode_named_tensors, shareable_buffer
from engines.sglang.weight_store import ERROR_PREFIX, GO, OK, SglangGroupSpec
from engines.sglang.weights import SglangWeightLoader
from engines.weights.base import WeightTransferError, require_usable
from engines.weights.group import failed_replies
from engines.weights.manifest import Manifest, plan_buckets
from engines.weights.names import SGLANG_TENSOR

STAGING_ALIGN = 64  # every staged tensor starts on this many bytes, so a view of any dtype lines up


class SglangTensorSender(SglangStoreSender):
    """The colocated mechanism: `open_group` hosts the store, and every bucket is handed over by reference."""

    def __init__(self, *, host: str = "127.0.0.1", gpus_per_engine: int = 1, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 timeout_s: float = 120.0) -> None:
        super().__init__(host=host, gpus_per_engine=gpus_per_engine, bucket_bytes=bucket_bytes, timeout_s=timeout_s)
        self._tcp_store: dist.TCPStore | None = None
        self._staging: Tensor | None = None  # one bucket's copy, which the servers read by handle
        self._staged_on: torch.device | None = None  # the device of the learner's tensors, once a push showed it

    def open_group(self, members: Sequence[str]) -> SglangGroupSpec:
        members = self._checked(members)
        self.close_group()
        self._tcp_store = dist.TCPStore(self.host, 0, is_master=True, wait_for_workers=False,
                                        timeout=timedelta(seconds=self.timeout_s))
        return self._new_spec(members, self._tcp_store.port, backend="none", transport=SGLANG_TENSOR)

    def wait_for_receivers(self, timeout_s: float | None = None) -> None:
        """Nothing to join: the servers are reached through their rollout workers' HTTP calls."""
        require_usable(self._tcp_store, None, "weight store")

    def _store(self) -> dist.Store | None:
        return self._tcp_store

    def _print_device(self) -> torch.device:
        """Where the learner's tensors are staged: known from the last push, else a GPU where there is one (a
        colocated learner's tensors are on it)."""
        if self._staged_on is not None:
            return self._staged_on
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def _buckets_done(self) -> None:
        if self._staging is not None and self._staging.device.type == "cuda":
            self._staging = None  # the GPU's bytes go back to the training step; host memory stays for the next

    def _deliver_bucket(self, keys: dist.Store, spec: SglangGroupSpec, dtype: torch.dtype | None,
                          timeout_s: float, position: int, pairs: list[tuple[str, Tensor]], where: str) -> None:
        held = self._stage(pairs, dtype)
        self._fingerprint_sent(held)
        for engine in spec.receivers:  # one pickle per server rank: each opening takes over its own reference
            for rank in range(self.gpus_per_engine):
                keys.set(f"payload/{position}/{engine}/{rank}", encode_named_tensors(held).encode())
        keys.set(f"bucket/{position}", GO)
        loaded = {engine: f"loaded/{position}/{engine}" for engine in spec.receivers}
        failed = failed_replies(keys, loaded, timeout_s, expected=OK,
                                silent=f"{where}: not loaded within {timeout_s:g}s",
                                stop=lambda: self._is_aborted() or bool(weight_store.early_failures(keys, spec)))
        if self._is_aborted():  # a live server may still be reading the buffer: the next push stages elsewhere
            self._staging = None
        if failed:  # every server copied the bucket or gave up on it: the staging buffer is free again
            raise WeightTransferError(f"{where} failed", {**failed, **weight_store.early_failures(keys, spec)})

    def _stage(self, named: list[tuple[str, Tensor]], dtype: torch.dtype | None) -> list[tuple[str, Tensor]]:
        """Copy a bucket into the staging buffer, cast to `dtype` on the way; returns views of it by name.

        A copy, because the next training step must not change what the server is reading; one reused buffer,
        because fresh shared memory for every bucket costs a page fault per page, on both sides."""
        layout, offset = [], 0
        for name, tensor in named:
            wire_dtype = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
            layout.append((name, tensor, wire_dtype, offset))
            offset += -(-tensor.numel() * wire_dtype.itemsize // STAGING_ALIGN) * STAGING_ALIGN
        device = named[0][1].device if named else torch.device("cpu")
        self._staged_on = device
        if self._staging is None or self._staging.device != device or self._staging.numel() < offset:
            self._staging = None  # the old buffer goes before the new one is made
            self._staging = shareable_buffer(offset, device)
        staged = []
        for name, tensor, wire_dtype, start in layout:
            size = tensor.numel() * wire_dtype.itemsize
            view = self._staging[start : start + size].view(wire_dtype).view(tensor.shape)
            view.copy_(tensor.detach())
            staged.append((name, view))
        if device.type == "cuda":  # torch's IPC event covers this too; the copies are done before any server looks
            torch.cuda.current_stream(device).synchronize()
        return staged

    def close_group(self) -> None:
        self._tcp_store, self._spec = None, None  # the store's server stops with its last reference

    def close(self) -> None:
        self.close_group()
        self._staging = None


class SglangTensorLoader(SglangWeightLoader):
    """A rollout worker's end: relays each bucket's handles to its server; no group to join on the server."""

    async def _join(self, spec: SglangGroupSpec, timeout_s: float) -> None:
        if spec.gpus_per_engine < 1:
            raise WeightTransferError(f"{self.engine_name}: group {spec.group_name} has no rank per engine")

    async def _forget_group(self, timeout_s: float) -> None:
        """No group lives on the server: nothing to free after a failed transfer."""

    async def _load_buckets(self, keys: dist.PrefixStore, manifest: Manifest, spec: SglangGroupSpec, version: int,
                            timeout_s: float) -> str | None:
        buckets = plan_buckets(manifest.tensors, manifest.bucket_bytes, manifest.direct_bytes)
        for position in range(len(buckets)):
            word = await asyncio.to_thread(weight_store.wait_bucket, keys, position, timeout_s)
            if word != GO:
                return f"bucket {position + 1}/{len(buckets)} not sent: {word.decode(errors='replace')}"[:500]
            prefix = f"payload/{position}/{self.engine_name}"
            payloads = await asyncio.to_thread(
                lambda prefix=prefix: [keys.get(f"{prefix}/{rank}").decode() for rank in range(spec.gpus_per_engine)]
            )
            try:
                await self.engine.update_weights_from_tensor(
                    payloads=payloads,
                    # on the last call only, as on the broadcast path: a failed transfer leaves the version alone
                    weight_version=str(version) if position == len(buckets) - 1 else None,
                    timeout=timeout_s + 10,
                )
            except SglangError as error:
                await asyncio.to_thread(keys.set, f"loaded/{position}/{self.engine_name}",
                                        ERROR_PREFIX + f" {error}".encode()[:500])
                return str(error)[:500]
            await asyncio.to_thread(keys.set, f"loaded/{position}/{self.engine_name}", OK)
        return None




