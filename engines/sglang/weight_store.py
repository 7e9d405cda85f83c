"""The SGLang weight group's spec and the store protocol both ends of a transfer follow (see `weights.py`).

The learner hosts the rendezvous store; loaders connect to it as plain clients. Keys live under a prefix of our
own, per group and version: the manifest, each engine's "ready" (or why not), the learner's "go" (or "abort"),
its word on each bucket ("go" once its tensors are on their way, else why not), each engine's acknowledgement,
and, when the manifest asks for fingerprints, each engine's checksum of what it serves, written before its
acknowledgement (`checksums.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from itertools import islice
from typing import Any

import torch.distributed as dist
from torch import Tensor

from engines.sglang.checksums import ServedChecksum
from engines.weights.base import WeightTransferError
from engines.weights.group import ERROR_PREFIX, OK, failed_replies, missing_keys
from engines.weights.manifest import Manifest
from engines.weights.names import SGLANG
from engines.weights.stream import SourceBroke

KEY_PREFIX = "slipstream-xfer/"
GO = b"go"
READY = b"1"
ABORT_PREFIX = b"abort:"
STORE_POLL_S = 0.05  # how often the sender looks for a refusal while a bucket is in flight


@dataclass(frozen=True)
class SglangGroupSpec:
    """One group generation, as it travels to the rollout workers inside `WeightUpdateOrder.group`."""

    master_address: str
    master_port: int
    group_name: str
    generation: int
    members: tuple[str, ...]  # members[0] is the learner; then the engines in rank order
    gpus_per_engine: int = 1
    backend: str = "gloo"
    transport: str = SGLANG  # SGLANG: servers join a broadcast group; SGLANG_TENSOR: tensors by reference
    directory: str | None = None  # SGLANG_DISK: the folder each push is written into (`disk_weights.py`)
    local_directory: str | None = None  # ... and where each loader copies it for its server, if anywhere

    @property
    def receivers(self) -> tuple[str, ...]:
        return self.members[1:]

    @property
    def world_size(self) -> int:
        return 1 + len(self.receivers) * self.gpus_per_engine

    def rank_offset(self, engine: str) -> int:
        """SGLang's layout: engine i takes the ranks from 1 + i * gpus_per_engine."""
        if engine not in self.receivers:
            raise ValueError(f"{engine!r} is not an engine of weight group {self.group_name}: {self.receivers}")
        return 1 + self.receivers.index(engine) * self.gpus_per_engine

    def to_dict(self) -> dict[str, Any]:
        """Carries the mechanism's name, by which a rollout worker picks the loader for it."""
        return {**self.__dict__, "members": list(self.members)}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> SglangGroupSpec:
        return cls(**{**raw, "members": tuple(raw["members"])})


def keys_of(store: dist.Store, spec: SglangGroupSpec, version: int) -> dist.PrefixStore:
    return dist.PrefixStore(f"{KEY_PREFIX}{spec.group_name}/v{version}/", store)


def connect_keys(spec: SglangGroupSpec, version: int, timeout_s: float) -> dist.PrefixStore:
    try:
        store = dist.TCPStore(
            spec.master_address,
            spec.master_port,
            is_master=False,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
        )
    except (RuntimeError, dist.DistError) as error:
        raise WeightTransferError(
            f"cannot reach the learner's weight store at {spec.master_address}:{spec.master_port}: {error}"
        ) from error
    return keys_of(store, spec, version)


Stop = Callable[[], bool]
"""True once the sender gave the transfer up (`WeightSender.abort`): every wait below then ends within a poll."""


def never() -> bool:
    return False


def not_ready(keys: dist.Store, spec: SglangGroupSpec, timeout_s: float, stop: Stop = never) -> dict[str, str]:
    """Engines that did not say "ready" within `timeout_s`, or said why they cannot be, with the reason."""
    wanted = {engine: f"ready/{engine}" for engine in spec.receivers}
    return failed_replies(keys, wanted, timeout_s, expected=READY, silent="not ready to receive (died or stalled)",
                          stop=stop)


def open_transfer(keys: dist.Store, spec: SglangGroupSpec, manifest: Manifest, timeout_s: float,
                  stop: Stop = never) -> None:
    """Publish the manifest, wait for every engine's "ready" and say "go"; engines not ready within `timeout_s`
    are named in a WeightTransferError, after the others were told to stop."""
    keys.set("manifest", manifest.encode())
    missing = not_ready(keys, spec, timeout_s, stop)
    if missing or stop():
        why = "given up by the learner" if stop() else f"not ready: {', '.join(missing)}"
        keys.set("go", ABORT_PREFIX + f" {why}".encode())
        raise WeightTransferError(f"weight transfer of version {manifest.version} not started", missing)
    keys.set("go", GO)


BucketDelivery = Callable[[int, list[tuple[str, Tensor]], str], None]
"""(position, the bucket's (name, tensor) pairs, where) -> None: say "bucket i" and see the bucket through to every
engine, or raise WeightTransferError naming who failed."""


def send_buckets(keys: dist.Store, spec: SglangGroupSpec, manifest: Manifest, tensors: Iterable[tuple[str, Tensor]],
                 timeout_s: float, deliver: BucketDelivery, stop: Stop = never) -> None:
    """Open the transfer, then pull each bucket's tensors from the learner's stream (checked against its specs)
    only when it goes out, and hand it to `deliver`. If the stream breaks, or `stop` says the learner gave the
    transfer up, "bucket i" says so, so no engine waits for it, and a WeightTransferError says why. A delta push's
    `manifest` is published whole; its buckets are those of the encoded bytes (`Manifest.wire`)."""
    open_transfer(keys, spec, manifest, timeout_s, stop)
    buckets = manifest.wire().buckets()
    stream = iter(tensors)
    for position, bucket in enumerate(buckets):
        where = f"weight transfer of version {manifest.version}, bucket {position + 1}/{len(buckets)}"
        if stop():
            keys.set(f"bucket/{position}", ABORT_PREFIX + b" given up by the learner")
            raise WeightTransferError(f"{where} not started: the transfer was given up")
        try:
            pairs = list(islice(stream, len(bucket.entries)))
            if position == len(buckets) - 1:
                next(stream, None)  # past the last spec: raises SourceBroke if the source has more
        except SourceBroke as error:
            keys.set(f"bucket/{position}", ABORT_PREFIX + f" the learner's tensors broke: {error}".encode())
            raise WeightTransferError(f"{where} broke: the learner's tensors broke: {error}") from error
        deliver(position, pairs, where)


def early_failures(keys: dist.Store, spec: SglangGroupSpec) -> dict[str, str]:
    """Error acknowledgements already written (a loader acks before the last bucket only when refused)."""
    failed: dict[str, str] = {}
    for engine in spec.receivers:
        key = f"ack/{engine}"
        if keys.check([key]):
            ack = keys.get(key)
            if ack != OK:
                failed[engine] = ack.removeprefix(ERROR_PREFIX).decode(errors="replace").strip()
    return failed


def await_bucket(
    work: list[dist.Work], keys: dist.Store, spec: SglangGroupSpec, timeout_s: float, where: str, stop: Stop = never
) -> dict[str, str]:
    """Poll the bucket's broadcasts until they complete, a loader reports a refusal, `stop` says the learner gave
    the transfer up (every engine is then reported), or `timeout_s` passes.

    Only completed work is waited on (it returns at once, raising what the collective hit): a blocking `wait()`
    would hang on gloo until the group timeout and, on NCCL, not block at all. Returns the failed engines.
    """
    deadline = time.monotonic() + timeout_s
    delay, next_store_check = 0.0005, 0.0
    while True:
        if all(handle.is_completed() for handle in work):
            try:
                for handle in work:
                    handle.wait()
            except (RuntimeError, dist.DistError) as error:
                return early_failures(keys, spec) or dict.fromkeys(spec.receivers, f"broadcast failed: {error}")
            return {}
        now = time.monotonic()
        if now >= next_store_check:
            failed = early_failures(keys, spec)
            if failed:
                return failed
            if stop():
                return dict.fromkeys(spec.receivers, f"{where}: given up by the learner")
            next_store_check = now + STORE_POLL_S
        if now > deadline:
            pending = dict.fromkeys(spec.receivers, f"{where}: not received within {timeout_s:g}s")
            return {**pending, **early_failures(keys, spec)}
        time.sleep(delay)
        delay = min(delay * 2, STORE_POLL_S)


def read_manifest(keys: dist.Store, timeout_s: float, engine: str) -> Manifest:
    if missing_keys(keys, ["manifest"], timeout_s):
        raise WeightTransferError(f"{engine}: the learner published no manifest within {timeout_s:g}s")
    try:
        return Manifest.decode(keys.get("manifest"))
    except ValueError as error:
        raise WeightTransferError(f"{engine}: unreadable weight manifest: {error}") from error


def wait_go(keys: dist.Store, timeout_s: float, engine: str, version: int) -> bytes:
    if missing_keys(keys, ["go"], timeout_s):
        raise WeightTransferError(f"{engine}: the learner never started the transfer of version {version}")
    return keys.get("go")


def wait_bucket(keys: dist.Store, position: int, timeout_s: float) -> bytes:
    """The learner's word on bucket `position`: GO once its tensors are on their way, else why not."""
    key = f"bucket/{position}"
    try:
        if missing_keys(keys, [key], timeout_s):
            return f"the learner did not start it within {timeout_s:g}s".encode()
        return keys.get(key)
    except (RuntimeError, dist.DistError) as error:  # the learner (and the store it hosts) went away
        return f"the learner's store is unreachable: {error}".encode()[:300]


def checksum_key(engine: str) -> str:
    return f"checksum/{engine}"


def served_checksums(keys: dist.Store, spec: SglangGroupSpec) -> dict[str, ServedChecksum]:
    """Each engine's checksum report, read once every engine acknowledged; a missing or unreadable one says why."""
    served: dict[str, ServedChecksum] = {}
    for engine in spec.receivers:
        key = checksum_key(engine)
        if not keys.check([key]):
            served[engine] = ServedChecksum(None, "its loader reported no checksum")
            continue
        try:
            served[engine] = ServedChecksum.decode(keys.get(key))
        except ValueError as error:
            served[engine] = ServedChecksum(None, str(error))
    return served


def acks(keys: dist.Store, spec: SglangGroupSpec, timeout_s: float, stop: Stop = never) -> dict[str, str]:
    wanted = {engine: f"ack/{engine}" for engine in spec.receivers}
    return failed_replies(keys, wanted, timeout_s, expected=OK, stop=stop,
                          silent=f"no acknowledgement within {timeout_s:g}s (died or stalled)")
