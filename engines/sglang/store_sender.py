"""The learner's side of a transfer to SGLang servers, whatever carries the bytes: the shared template.

Both SGLang mechanisms (a broadcast group the servers join, `weights.py`; handles to the learner's memory for
colocated servers, `tensor_weights.py`) run the same store protocol (`weight_store.py`) and differ only in how a
bucket reaches the servers, so a mechanism supplies `_store` (where the protocol's keys live) and
`_deliver_bucket`; the manifest, readiness, the word per bucket, acknowledgements, the weight check, the commit
and the report are here once.

The weight check (`fingerprint=True`): SGLang loads the pushed tensors into its own layout, so the servers cannot
be compared with what was sent tensor by tensor. Each loader reports its server's own checksum after the load, and
`checksums.py` judges the push from them, the sender's prints of what it sent and the last committed push.
"""

from __future__ import annotations

import secrets
import time
from abc import abstractmethod
from collections.abc import Iterable, Mapping
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor

from engines.sglang import weight_store
from engines.sglang.checksums import Baseline, check_checksums
from engines.sglang.weight_store import ABORT_PREFIX, SglangGroupSpec
from engines.weights.base import TransferReport, WeightsDiffer, WeightSender, WeightTransferError, require_usable
from engines.weights.fingerprint import FingerprintCheck, Fingerprints, algorithm_for
from engines.weights.manifest import Manifest
from engines.weights.stream import SourceBroke, SpecifiedTensors, specified, wire_specs

# One HTTP call per bucket: larger buckets mean fewer calls; the server allocates a bucket's tensors at once.
DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024


class SglangStoreSender(WeightSender):
    """Learner rank 0. `open_group(members)`, hand the spec to the rollout workers, `wait_for_receivers()`,
    then `send(...)` per version; after a WeightTransferError, `open_group` again."""

    def __init__(self, *, host: str, gpus_per_engine: int, bucket_bytes: int, timeout_s: float) -> None:
        if bucket_bytes <= 0 or gpus_per_engine < 1:
            raise ValueError(
                f"bucket_bytes and gpus_per_engine must be positive, got {bucket_bytes}, {gpus_per_engine}"
            )
        self.host, self.gpus_per_engine = host, gpus_per_engine
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self._run_token = secrets.token_hex(4)  # group names never repeat, even across learner restarts
        self._generation = -1
        self._spec: SglangGroupSpec | None = None
        self._broken: str | None = None
        self._committed: int | None = None
        self._aborted: dict[str, str] | None = None  # set by abort(), from any thread; cleared by the next group
        self._sent: Fingerprints | None = None  # the prints of the push under way, when it is checked
        self._baseline: Baseline | None = None  # the last committed checked push (`checksums.py`)

    @property
    def committed_version(self) -> int | None:
        return self._committed

    @property
    def spec(self) -> SglangGroupSpec | None:
        return self._spec

    @abstractmethod
    def _store(self) -> dist.Store | None:
        """The store the open group's keys live in; None before the group is usable."""

    @abstractmethod
    def _deliver_bucket(self, keys: dist.Store, spec: SglangGroupSpec, dtype: torch.dtype | None, timeout_s: float,
                        position: int, pairs: list[tuple[str, Tensor]], where: str) -> None:
        """Say "bucket `position`" and see its `pairs` through to every server, or raise WeightTransferError."""

    def _transfer_begins(self, manifest: Manifest) -> None:
        """Before the first bucket of a push (whose plan `manifest` gives) goes out."""

    def _buckets_done(self) -> None:
        """After the last bucket (or a failure): let go of what only the buckets needed."""

    def _print_device(self) -> torch.device:
        """The device the pushed tensors go out from, whose fingerprint algorithm the sender's prints use."""
        return torch.device("cpu")

    def _fingerprint_sent(self, named: Iterable[tuple[str, Tensor]]) -> None:
        """A mechanism calls this with each bucket's tensors as they went out (in the wire dtype), when the push
        is checked: the sender's own prints, to tell what changed since the last committed push."""
        if self._sent is not None:
            for name, tensor in named:
                self._sent.add(name, tensor)

    def abort(self, failed: Mapping[str, str]) -> None:
        """A member of the open group died or was replaced (the learner's roster says so): every wait of a
        `wait_for_receivers` or `send` under way ends within a poll and raises naming `failed`, instead of waiting
        out the transfer timeout for a server that is gone."""
        if self._aborted is None:
            self._aborted = dict(failed) or {"(unnamed)": "aborted"}

    def _is_aborted(self) -> bool:
        return self._aborted is not None

    def _named(self, error: WeightTransferError) -> WeightTransferError:
        """`error`, or, once `abort()` came, the same failure blamed on the members it named."""
        if self._aborted is None:
            return error
        return WeightTransferError(f"{error} (given up: {self._aborted})", self._aborted)

    def send(self, named_tensors: Iterable[tuple[str, Tensor]], version: int, *, dtype: torch.dtype | None = None,
             timeout_s: float | None = None, fingerprint: bool = False) -> TransferReport:
        """Bucket by bucket, each awaited with a deadline; any failure raises WeightTransferError only.

        The manifest (every name, dtype and shape) must reach the loaders before the first byte: given a
        `SpecifiedTensors` it comes from the recorded specs and each bucket's tensors are pulled when it goes out;
        a bare iterable is listed first (references only). Each tensor is cast and copied only when its bucket goes
        out: a bucket's copies at most, never the whole model a second time.

        `fingerprint`: the tensors are fingerprinted as they go out, each server's checksum is read after the
        load, and the version is committed only if no engine is shown to serve other weights (`checksums.py`):
        otherwise `WeightsDiffer` names the engines. The report says which engines could not be checked.
        """
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        spec = self._require_spec()
        store = self._store()
        require_usable(store, self._broken, f"weight group {spec.group_name}")
        assert store is not None
        started = time.perf_counter()
        tensors = specified(named_tensors)
        algorithm = algorithm_for(self._print_device()) if fingerprint else None
        manifest = Manifest(version=version, bucket_bytes=self.bucket_bytes, direct_bytes=self.bucket_bytes,
                            tensors=wire_specs(tensors.specs, dtype), fingerprint=algorithm)
        self._sent = Fingerprints(algorithm) if algorithm is not None else None
        keys = weight_store.keys_of(store, spec, version)
        try:
            manifest, stream = self._planned(keys, manifest, tensors)
            self._transfer_begins(manifest)
            weight_store.send_buckets(keys, spec, manifest, stream, timeout_s,
                                      partial(self._deliver_bucket, keys, spec, dtype, timeout_s), self._is_aborted)
        except WeightTransferError as error:
            # A source that broke leaves nothing pending (every earlier bucket completed), and the store must stay
            # up until the loaders read the word: it goes at the next open_group.
            self._broken = self._broken or str(error)
            raise self._named(error) from error
        finally:
            self._buckets_done()
        failed = weight_store.acks(keys, spec, timeout_s, self._is_aborted)
        if failed:
            self._broken = f"version {version} not acknowledged: {failed}"
            raise self._named(WeightTransferError(f"weight transfer of version {version} not committed", failed))
        check = self._check_served(keys, spec, version, sent_in_16_bits=all(
            tensor.dtype in (torch.bfloat16, torch.float16) for tensor in manifest.tensors
            if tensor.dtype.is_floating_point))
        if check is not None and not check.ok:  # the group is fine: the next push goes through it
            raise WeightsDiffer(f"weight transfer of version {version} not committed: {check.describe()}", check)
        self._committed = version
        wire = manifest.wire()
        return TransferReport(version=version, receivers=spec.receivers, num_tensors=len(manifest.tensors),
                              num_buckets=len(wire.buckets()), num_bytes=wire.total_bytes,
                              seconds=time.perf_counter() - started, fingerprints=check,
                              delta_base=manifest.base_version, full_bytes=manifest.total_bytes)

    def _plan(self, manifest: Manifest, tensors: SpecifiedTensors) -> tuple[Manifest, Iterable[tuple[str, Tensor]]]:
        """The manifest to publish and the (name, tensor) pairs its buckets carry, before anything is published: a
        mechanism that can send less (the shared folder's deltas) turns the push into a delta here."""
        return manifest, tensors

    def _planned(self, keys: dist.Store, manifest: Manifest,
                 tensors: SpecifiedTensors) -> tuple[Manifest, Iterable[tuple[str, Tensor]]]:
        """`_plan`, and if the learner's tensors break while it reads them, the loaders are told so (they wait for
        a manifest, then for "go") and a WeightTransferError says why."""
        try:
            return self._plan(manifest, tensors)
        except SourceBroke as error:
            keys.set("manifest", manifest.encode())
            keys.set("go", ABORT_PREFIX + f" the learner's tensors broke: {error}".encode()[:500])
            raise WeightTransferError(f"weight transfer of version {manifest.version} not started: the learner's "
                                      f"tensors broke: {error}") from error

    def _check_served(self, keys: dist.Store, spec: SglangGroupSpec, version: int, *,
                      sent_in_16_bits: bool) -> FingerprintCheck | None:
        """The verdict of a checked push (None: not checked) from every engine's checksum report; a push that passes
        becomes the baseline the next one is compared with."""
        sent, self._sent = self._sent, None
        if sent is None:
            return None
        prints = sent.values()
        served = weight_store.served_checksums(keys, spec)
        check = check_checksums(sent.algorithm, prints, served, self._baseline, sent_in_16_bits=sent_in_16_bits)
        if check.ok:
            checksums = {engine: answer.checksum for engine, answer in served.items() if answer.checksum is not None}
            self._baseline = Baseline(version, sent.algorithm, prints, checksums)
        return check

    @staticmethod
    def _checked(members: Iterable[str]) -> tuple[str, ...]:
        members = tuple(members)
        if len(members) < 2:
            raise ValueError(f"a weight group needs the learner and at least one engine, got {list(members)}")
        return members

    def _new_spec(self, members: tuple[str, ...], port: int, **mechanism: object) -> SglangGroupSpec:
        """The next generation's spec; its group name never repeats."""
        self._generation += 1
        self._broken, self._aborted = None, None
        self._spec = SglangGroupSpec(master_address=self.host, master_port=port,
                                     group_name=f"slipstream-{self._run_token}-g{self._generation}",
                                     generation=self._generation, members=members,
                                     gpus_per_engine=self.gpus_per_engine, **mechanism)  # type: ignore[arg-type]
        return self._spec

    def _require_spec(self) -> SglangGroupSpec:
        if self._spec is None:
            raise WeightTransferError("no weight group is open; call open_group() first")
        return self._spec
