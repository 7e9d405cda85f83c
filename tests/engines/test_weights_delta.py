"""Delta pushes over torch.distributed: after a full push, a push sends only what changed, and every engine ends bit
for bit where a full push would have left it (plain receivers, a torch engine's weights, a LoRA-merged engine, an
MoE model's expert slices); a wrong delta fails the fingerprint and the next push is full and repairs it; a full
anchor every K versions, and on a new group generation (an engine that joins late). Over the shared folder
(`engines.weights.disk`) too: the same protocol, files in place of the broadcast."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
import structlog
import torch
from safetensors import safe_open
from torch import Tensor
from transformers import AutoModelForCausalLM

from engines.inference.torch_engine import TorchEngine
from engines.weights import delta, disk_files, layouts
from engines.weights.base import TransferReport, WeightsDiffer, WeightTransferError
from engines.weights.disk import DiskWeightReceiver, DiskWeightSender
from engines.weights.disk_files import VersionWriter
from engines.weights.fingerprint import FingerprintPlan, ServedPrints, fingerprint_all
from engines.weights.group import GroupSpec
from engines.weights.held import ReceiverCopy, SenderCopy
from engines.weights.local_checkpoint import LocalCheckpoint, expected_prints
from engines.weights.manifest import Manifest, TensorSpec
from engines.weights.torch_distributed import TorchDistributedWeightSender
from engines.weights.torch_receiver import TorchDistributedWeightReceiver
from engines.weights.transport import SenderOptions, resolve_transport
from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model

TIMEOUT_S = 60.0


# ------------------------------------------------------------------------------------------------ the encoding
@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.uint8, torch.bool])
@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.3, 1.0])
def test_every_encoding_carries_exactly_the_changed_bits(dtype: torch.dtype, fraction: float) -> None:
    generator = torch.Generator().manual_seed(0)
    old = (torch.randn(37, 11, generator=generator) * 50).to(dtype)
    new = old.clone()
    picked = torch.rand(old.numel(), generator=generator) < fraction
    new.view(-1)[picked] = (torch.randn(int(picked.sum()), generator=generator) * 50).to(dtype)
    if dtype.is_floating_point:  # bits, not values: -0.0 replaces 0.0, a NaN stays a NaN
        old.view(-1)[0], new.view(-1)[0] = 0.0, -0.0
        old.view(-1)[1], new.view(-1)[1] = float("nan"), float("nan")
    mask = delta.changed(old, new)
    for encoding in delta.ENCODINGS:
        payload = delta.encode(encoding, mask, new)
        assert payload.numel() == delta.encoded_nbytes(encoding, new.numel(), int(mask.sum()), new.element_size())
        target = old.clone()
        delta.apply(encoding, payload, int(mask.sum()), target)
        assert torch.equal(target.view(-1).view(torch.uint8), new.view(-1).view(torch.uint8)), encoding


@pytest.mark.unit
def test_the_smallest_encoding_follows_how_many_elements_changed() -> None:
    numel = 1 << 16  # bfloat16: indices cost 6 bytes a change, a bitmap 1/8 a byte an element plus 2 a change
    assert delta.smallest(numel, 0, 2) == delta.SPARSE and delta.encoded_nbytes(delta.SPARSE, numel, 0, 2) == 0
    assert delta.smallest(numel, numel // 100, 2) == delta.SPARSE
    assert delta.smallest(numel, numel // 2, 2) == delta.BITMAP
    assert delta.smallest(numel, numel, 2) == delta.DENSE


@pytest.mark.unit
def test_a_payload_of_the_wrong_size_is_refused_saying_what_was_expected() -> None:
    target = torch.zeros(10)
    with pytest.raises(ValueError, match="delta payload of 3 bytes, expected 16 for 2 changed of 10"):
        delta.apply(delta.SPARSE, torch.zeros(3, dtype=torch.uint8), 2, target)


@pytest.mark.unit
def test_a_delta_manifest_travels_and_a_malformed_one_is_refused() -> None:
    specs = (TensorSpec("a", torch.bfloat16, (4, 8)), TensorSpec("b", torch.float32, (3,)))
    manifest = Manifest(version=5, bucket_bytes=1024, direct_bytes=512, tensors=specs, keep=True, base_version=4,
                        changes=((delta.SPARSE, 2), (delta.DENSE, 3)))
    assert Manifest.decode(manifest.encode()) == manifest
    assert manifest.wire().tensors == (TensorSpec("a", torch.uint8, (8 + 4,)), TensorSpec("b", torch.uint8, (12,)))
    broken = manifest.encode().replace(b'["sparse",2]', b'["xor",2]')
    with pytest.raises(ValueError, match="changes must list an"):
        Manifest.decode(broken)


@pytest.mark.unit
def test_a_local_checkpoint_takes_a_delta_in_place_misaligned_tensors_too_and_refuses_one_against_another_version(
        tmp_path: Path) -> None:
    """An SGLang host's checkpoint (`local_checkpoint.py`), here a hand-made file whose float32 tensor starts at a
    byte offset no float32 aligns to (safetensors' own writer never makes one; another writer may)."""
    old = {"a": torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16), "b": torch.arange(4.0).reshape(2, 2)}
    new = {"a": torch.tensor([1.0, 2.5, 3.0], dtype=torch.bfloat16), "b": torch.tensor([[0.0, 1.0], [7.0, 3.0]])}
    header = json.dumps({"a": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]},
                         "b": {"dtype": "F32", "shape": [2, 2], "data_offsets": [6, 22]}}).encode()
    header += b" " * (-len(header) % 8)
    root = tmp_path / "local"
    root.mkdir()
    shard = disk_files.shard_name(0, 1)
    (root / shard).write_bytes(len(header).to_bytes(8, "little") + header + b"".join(
        old[name].view(torch.uint8).numpy().tobytes() for name in ("a", "b")))
    (root / disk_files.INDEX).write_text(json.dumps({"weight_map": dict.fromkeys(old, shard)}))
    specs = tuple(TensorSpec(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in old.items())
    changes = []
    for spec in specs:
        count = delta.count(delta.changed(old[spec.name], new[spec.name]))
        changes.append((delta.smallest(spec.numel, count, spec.dtype.itemsize), count))
    manifest = Manifest(version=2, bucket_bytes=1024, direct_bytes=1024, tensors=specs, base_version=1,
                        changes=tuple(changes))
    writer = VersionWriter(tmp_path / "pushes", 2, len(manifest.wire().buckets()))
    writer.write(0, [(spec.name, delta.encode(encoding, delta.changed(old[spec.name], new[spec.name]), new[spec.name]))
                     for spec, (encoding, _) in zip(specs, changes, strict=True)], delta=True)
    writer.finish(manifest.encode(), ("rollout-0",), None,
                  {disk_files.PRINTS: expected_prints("xxh3", fingerprint_all(new.items(), "xxh3"))})
    checkpoint = LocalCheckpoint(root)
    checkpoint.version = 1
    assert checkpoint.patch(writer.path, manifest) == root and checkpoint.version == 2
    with safe_open(str(root / shard), framework="pt") as handle:
        assert all(torch.equal(handle.get_tensor(name), tensor) for name, tensor in new.items())
    with pytest.raises(ValueError, match=r"a delta against version 1, but the local checkpoint .* holds version 2"):
        checkpoint.patch(writer.path, manifest)


@pytest.mark.unit
def test_an_engine_refuses_a_delta_against_a_version_it_does_not_hold() -> None:
    copy = ReceiverCopy(torch.device("cpu"))
    manifest = Manifest(version=5, bucket_bytes=1024, direct_bytes=512, keep=True, base_version=4,
                        tensors=(TensorSpec("a", torch.float32, (2,)),), changes=((delta.DENSE, 2),))
    load = copy.load_fn(manifest, lambda named: None)
    with pytest.raises(ValueError, match="a delta against version 4, but this engine holds no kept version"):
        load([("a", torch.zeros(8, dtype=torch.uint8))])


# ------------------------------------------------------------------------------- pushes to plain receivers
def _versions(count: int, seed: int = 0) -> list[list[tuple[str, Tensor]]]:
    """fp32 master weights moved like a small optimizer step: most bf16 elements keep their bits, fp32 ones do not;
    one tensor never changes, an integer one changes now and then, one changes a few elements only."""
    generator = torch.Generator().manual_seed(seed)
    weights = {"embed": torch.randn(96, 40, generator=generator), "q_proj": torch.randn(40, 40, generator=generator),
               "norm": torch.ones(40), "down_proj": torch.randn(40, 24, generator=generator),
               "counter": torch.tensor([3, 1, 4], dtype=torch.int64), "rows": torch.randn(64, 8, generator=generator)}
    versions = []
    for version in range(count):
        if version:
            for name in ("embed", "q_proj", "down_proj"):
                weights[name] = weights[name] + torch.randn(weights[name].shape, generator=generator) * 1e-3
            weights["rows"] = weights["rows"].clone()
            weights["rows"][version % 64] += 1.0
            weights["counter"] = weights["counter"] + (version % 2)
        versions.append([(name, tensor.clone()) for name, tensor in weights.items()])
    return versions


class _Engine:
    """A receiver in a thread: loads every push into `live` (as float32 with `wide`: an engine that keeps wider
    weights), offers the tensors named in `offered` for deltas to write in place, fingerprints `live` when asked,
    and records what each receive returned or raised and which tensors each push loaded."""

    def __init__(self, spec: GroupSpec, name: str, pushes: int, *, offered: frozenset[str] = frozenset(),
                 wide: bool = False) -> None:
        self.live: dict[str, Tensor] = {}
        self.outcomes: list[int | str] = []
        self.loads: list[list[str]] = []
        self.after_load: Callable[[int, dict[str, Tensor]], None] | None = None
        self._offered, self._wide = offered, wide
        self._thread = threading.Thread(target=self._run, args=(spec, name, pushes), daemon=True)
        self._thread.start()

    def _run(self, spec: GroupSpec, name: str, pushes: int) -> None:
        kind = DiskWeightReceiver if spec.backend == "disk" else TorchDistributedWeightReceiver
        receiver = kind.join(spec, name, timeout_s=TIMEOUT_S)
        try:
            for _ in range(pushes):
                self.loads.append([])
                try:
                    self.outcomes.append(receiver.receive(self._load, TIMEOUT_S, finish_fn=self._finish,
                                                          fingerprint_fn=self._prints, in_place=self._in_place))
                except WeightTransferError as error:
                    self.outcomes.append(str(error))
        finally:
            receiver.close()

    def _load(self, named: Iterable[tuple[str, Tensor]]) -> None:
        for name, tensor in named:
            self.loads[-1].append(name)
            dtype = torch.float32 if self._wide and tensor.is_floating_point() else tensor.dtype
            if name not in self.live or self.live[name].dtype != dtype:
                self.live[name] = torch.empty_like(tensor, dtype=dtype)
            self.live[name].copy_(tensor)

    def _in_place(self, name: str) -> Tensor | None:
        return self.live.get(name) if name in self._offered else None

    def _finish(self, version: int) -> None:
        if self.after_load is not None:
            self.after_load(version, self.live)

    def _prints(self, specs: tuple[TensorSpec, ...], plan: FingerprintPlan) -> ServedPrints:
        prints = plan.prints()
        for spec in plan.covered(specs):
            prints.add(spec.name, self.live[spec.name], spec.dtype)
        return ServedPrints(prints.values())

    def join(self) -> None:
        self._thread.join(TIMEOUT_S)
        assert not self._thread.is_alive()


def _bits(named: Iterable[tuple[str, Tensor]], dtype: torch.dtype | None) -> dict[str, bytes]:
    return {name: (tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor).contiguous()
            .view(-1).view(torch.uint8).numpy().tobytes() for name, tensor in named}


def _send(sender: TorchDistributedWeightSender, named: list[tuple[str, Tensor]], version: int,
          dtype: torch.dtype | None) -> TransferReport | WeightsDiffer:
    try:
        return sender.send(iter(named), version, dtype=dtype, fingerprint=True)
    except WeightsDiffer as differ:
        return differ


def _push_each(sender: TorchDistributedWeightSender, engines: list[_Engine],
               versions: list[list[tuple[str, Tensor]]], dtype: torch.dtype | None) -> list[TransferReport]:
    """Every version in turn to the engines of the sender's open group; then the group closes and they finish."""
    outcomes = []
    try:
        sender.wait_for_receivers(TIMEOUT_S)
        outcomes = [_send(sender, named, version, dtype) for version, named in enumerate(versions)]
    finally:
        sender.close()
    for engine in engines:
        engine.join()
    reports = [outcome for outcome in outcomes if isinstance(outcome, TransferReport)]
    assert reports == outcomes, outcomes
    return reports


@pytest.mark.integration
@pytest.mark.parametrize("backend", ["gloo", "shm", "disk"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_a_delta_push_leaves_every_engine_bit_for_bit_where_a_full_push_would(backend: str, dtype: torch.dtype | None,
                                                                              tmp_path: Path) -> None:
    versions = _versions(5)
    options = {"bucket_bytes": 4096, "direct_bytes": 2048, "delta_sync": True, "delta_backoff": 0}
    sender = (DiskWeightSender(directory=tmp_path, **options) if backend == "disk" else
              TorchDistributedWeightSender(backend=backend, **options))
    spec = sender.open_group(["learner", "engine-0", "engine-1"])
    engines = [_Engine(spec, name, len(versions)) for name in ("engine-0", "engine-1")]
    reports = _push_each(sender, engines, versions, dtype)
    assert all(report.fingerprints is not None and report.fingerprints.ok for report in reports)
    assert [report.delta_base for report in reports] == [None, 0, 1, 2, 3]
    assert reports[0].full_because == "no version pushed yet" and reports[1].full_because is None
    full_bytes = reports[0].num_bytes
    assert all(report.full_bytes == full_bytes for report in reports)
    if dtype == torch.bfloat16:  # a 1e-3 step keeps most bf16 bits: far fewer bytes than whole
        assert all(report.num_bytes < full_bytes / 2 for report in reports[1:])
    for engine in engines:
        assert engine.outcomes == [0, 1, 2, 3, 4]
        assert _bits(engine.live.items(), None) == _bits(versions[-1], dtype)
    assert list(tmp_path.iterdir()) == []  # each version's folder went once its push was over


@pytest.mark.integration
@pytest.mark.parametrize("wide", [False, True])
def test_a_delta_goes_in_place_into_the_tensors_an_engine_offers_and_through_a_kept_copy_for_the_rest(
        wide: bool) -> None:
    versions = _versions(4, seed=5)
    offered = frozenset({"embed", "q_proj", "down_proj", "norm", "counter", "rows"})
    sender = TorchDistributedWeightSender(delta_sync=True, delta_backoff=0)
    spec = sender.open_group(["learner", "engine-0", "engine-1"])
    everything = _Engine(spec, "engine-0", len(versions), offered=offered, wide=wide)
    some = _Engine(spec, "engine-1", len(versions), offered=offered - {"q_proj", "rows"}, wide=wide)
    reports = _push_each(sender, [everything, some], versions, torch.bfloat16)
    assert [report.delta_base for report in reports] == [None, 0, 1, 2]
    assert all(report.fingerprints is not None and report.fingerprints.ok for report in reports)
    assert everything.loads[1:] == [[], [], []]  # wholly in place: one empty load, so the engine takes the version
    assert all(set(loaded) == {"q_proj", "rows"} for loaded in some.loads[1:])  # changed, and not offered
    for engine in (everything, some):
        assert _bits(((name, tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor)
                      for name, tensor in engine.live.items()), None) == _bits(versions[-1], torch.bfloat16)


@pytest.mark.integration
def test_a_planted_wrong_delta_fails_the_certificate_and_the_next_push_is_full_and_repairs_it() -> None:
    versions = _versions(4, seed=1)
    sender = TorchDistributedWeightSender(delta_sync=True, delta_backoff=0)
    spec = sender.open_group(["learner", "engine-0"])
    engine = _Engine(spec, "engine-0", len(versions))
    try:
        sender.wait_for_receivers(TIMEOUT_S)
        first = _send(sender, versions[0], 0, torch.bfloat16)
        second = _send(sender, versions[1], 1, torch.bfloat16)
        # The plant: the sender's copy of q_proj already has version 2's first element, so the delta leaves that
        # element out and the engine keeps version 1's.
        held = sender._copy._held["q_proj"]
        new_first = versions[2][1][1].to(torch.bfloat16).view(-1)[0]
        assert not torch.equal(held.view(-1)[0], new_first)
        held.view(-1)[0] = new_first
        planted = _send(sender, versions[2], 2, torch.bfloat16)
        repair = _send(sender, versions[3], 3, torch.bfloat16)
    finally:
        sender.close()
    engine.join()
    assert isinstance(first, TransferReport) and isinstance(second, TransferReport) and second.delta_base == 0
    assert isinstance(planted, WeightsDiffer) and planted.check.differ == {"engine-0": ["q_proj"]}
    assert sender.committed_version == 3
    assert isinstance(repair, TransferReport) and repair.delta_base is None
    assert repair.full_because == "repair after version 2's push was served differently (the fingerprints differ)"
    assert _bits(engine.live.items(), None) == _bits(versions[3], torch.bfloat16)


@pytest.mark.integration
def test_a_full_anchor_goes_every_k_versions() -> None:
    versions = _versions(7, seed=2)
    sender = TorchDistributedWeightSender(delta_sync=True, anchor_every=3, delta_backoff=0)
    spec = sender.open_group(["learner", "engine-0"])
    engine = _Engine(spec, "engine-0", len(versions))
    reports = _push_each(sender, [engine], versions, torch.bfloat16)
    assert [report.delta_base for report in reports] == [None, 0, 1, None, 3, 4, None]
    assert reports[3].full_because == "the anchor every 3 versions"
    assert _bits(engine.live.items(), None) == _bits(versions[-1], torch.bfloat16)


@pytest.mark.unit
def test_a_delta_slower_than_a_full_push_is_followed_by_full_ones_then_tried_again() -> None:
    """Weighed by the seconds the pushes took (given here, as a sender reports them): a delta that took longer than
    the last full push's seconds per byte say a full one would, stops deltas for `backoff` pushes, twice as many
    after the next slower one in a row; of those full pushes only the last keeps its tensors (a delta follows it).
    A delta that was faster changes nothing and resets the wait; `backoff` 0 keeps deltas whatever they cost."""
    specs = (TensorSpec("w", torch.bfloat16, (500,)),)
    copy = SenderCopy(torch.device("cpu"), backoff=2)

    def full_pushes(first: int, count: int, seconds: float = 2.0) -> list[bool]:
        kept = []
        for version in range(first, first + count):
            assert copy.base_for(specs, 0)[0] is None
            kept.append(copy.keeps())
            copy.committed(version, specs, 0, was_delta=False, seconds=seconds, full_bytes=1000)
        return kept

    copy.committed(0, specs, 0, was_delta=False, seconds=1.0, full_bytes=1000)
    copy.committed(1, specs, 0, was_delta=True, seconds=0.9, full_bytes=1000)
    assert copy.base_for(specs, 0) == (1, "") and copy.keeps()
    copy.committed(2, specs, 0, was_delta=True, seconds=1.5, full_bytes=1000)
    assert copy.base_for(specs, 0) == (None, "a delta push took 1.500 s, a full one 1.000 s: 2 full pushes before "
                                             "the next delta")
    assert full_pushes(3, 2) == [False, True]
    assert copy.base_for(specs, 0) == (4, "")
    copy.committed(5, specs, 0, was_delta=True, seconds=2.5, full_bytes=1000)  # slower again: twice the wait
    assert full_pushes(6, 4) == [False, False, False, True]
    copy.committed(10, specs, 0, was_delta=True, seconds=1.9, full_bytes=1000)  # faster: the wait is back to 2
    copy.committed(11, specs, 0, was_delta=True, seconds=2.1, full_bytes=1000)
    assert full_pushes(12, 2) == [False, True] and copy.base_for(specs, 0) == (13, "")
    stubborn = SenderCopy(torch.device("cpu"), backoff=0)
    stubborn.committed(0, specs, 0, was_delta=False, seconds=1.0, full_bytes=1000)
    stubborn.committed(1, specs, 0, was_delta=True, seconds=9.0, full_bytes=1000)
    assert stubborn.base_for(specs, 0) == (1, "") and stubborn.keeps()


@pytest.mark.integration
def test_after_a_slow_delta_the_full_pushes_keep_nothing_but_the_last_and_the_next_delta_lands_bit_for_bit() -> None:
    """An engine that takes 2 s to apply version 1 (a delta): its push is slower than the full one before it, so
    version 2 goes whole keeping no copy at either end, version 3 whole kept, version 4 a delta again against it,
    onto the copy that version 2 dropped and version 3 refilled; every push fingerprinted, and the end state that
    of a full push."""
    versions = _versions(5, seed=5)
    sender = TorchDistributedWeightSender(delta_sync=True, delta_backoff=2)
    spec = sender.open_group(["learner", "engine-0"])
    engine = _Engine(spec, "engine-0", len(versions))  # offers nothing in place: it applies deltas to a kept copy
    engine.after_load = lambda version, live: time.sleep(2.0) if version == 1 else None
    reports = _push_each(sender, [engine], versions, torch.bfloat16)
    assert [report.delta_base for report in reports] == [None, 0, None, None, 3]
    assert reports[2].full_because is not None and reports[2].full_because.startswith("a delta push took ")
    assert all(report.fingerprints is not None and report.fingerprints.ok for report in reports)
    assert _bits(engine.live.items(), None) == _bits(versions[-1], torch.bfloat16)


@pytest.mark.integration
def test_an_engine_that_joins_late_gets_a_full_push_and_then_deltas_with_the_others() -> None:
    versions = _versions(4, seed=3)
    sender = TorchDistributedWeightSender(delta_sync=True, delta_backoff=0)
    spec = sender.open_group(["learner", "engine-0"])
    early = _Engine(spec, "engine-0", 2)
    try:
        sender.wait_for_receivers(TIMEOUT_S)
        reports = [_send(sender, versions[v], v, torch.bfloat16) for v in (0, 1)]
        early.join()
        spec = sender.open_group(["learner", "engine-0", "engine-1"])  # a new generation with the late engine
        engines = [_Engine(spec, name, 2) for name in ("engine-0", "engine-1")]
        sender.wait_for_receivers(TIMEOUT_S)
        reports += [_send(sender, versions[v], v, torch.bfloat16) for v in (2, 3)]
    finally:
        sender.close()
    for engine in engines:
        engine.join()
    assert [report.delta_base for report in reports] == [None, 0, None, 2]
    assert reports[2].full_because == "a new group generation: an engine joined, left or restarted"
    for engine in engines:
        assert _bits(engine.live.items(), None) == _bits(versions[3], torch.bfloat16)


@pytest.mark.integration
def test_with_delta_sync_off_every_push_is_full_and_nothing_is_kept() -> None:
    versions = _versions(2, seed=4)
    sender = TorchDistributedWeightSender()
    spec = sender.open_group(["learner", "engine-0"])
    reports = _push_each(sender, [_Engine(spec, "engine-0", 2)], versions, torch.bfloat16)
    assert [(report.delta_base, report.full_because) for report in reports] == [(None, None), (None, None)]
    assert sender._copy.nbytes == 0


# ------------------------------------------------------------------------------ pushes into torch engines
async def push_all(engine: TorchEngine, versions: list[list[tuple[str, Tensor]]], *, delta_sync: bool,
                   dtype: torch.dtype | None = None, prepare: Callable[[list[tuple[str, Tensor]]],
                                                               Iterable[tuple[str, Tensor]]] = iter,
                   ) -> list[TransferReport]:
    """Each version pushed in turn over one gloo group, fingerprinted, from this process into `engine`; `prepare`
    makes a version's push of its tensors (as a learner's publisher does: FP8's quantises them)."""
    transport = resolve_transport("torch_distributed")
    sender = transport.make_sender(SenderOptions(host="127.0.0.1", backend="gloo", timeout_s=30.0, delta_backoff=0))
    sender.delta_sync = delta_sync
    loader = transport.make_loader(engine, "rollout-0", structlog.get_logger())
    reports = []
    try:
        group = sender.open_group(["learner", "rollout-0"]).to_dict()
        for version, named in enumerate(versions):
            loading = asyncio.create_task(loader.apply(group, version, 30.0))
            if version == 0:
                await asyncio.to_thread(sender.wait_for_receivers)
            reports.append(await asyncio.to_thread(sender.send, prepare(named), version, dtype=dtype,
                                                   fingerprint=True))
            await loading
    finally:
        loader.close()
        sender.close()
    return reports


def _moved(named: list[tuple[str, Tensor]], seed: int, scale: float = 1e-3) -> list[tuple[str, Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(name, tensor + torch.randn(tensor.shape, generator=generator) * scale) for name, tensor in named]


async def _served_after(model_path: Path, versions: list[list[tuple[str, Tensor]]], *, delta_sync: bool,
                        dtype: torch.dtype | None, lora_scaling: float | None = None,
                        ) -> tuple[dict[str, bytes], list[TransferReport]]:
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    async with TorchEngine(model, None, lora_scaling=lora_scaling) as engine:
        reports = await push_all(engine, versions, delta_sync=delta_sync, dtype=dtype)
    return _bits(model.state_dict().items(), None), reports


async def _delta_equals_full(model_path: Path, versions: list[list[tuple[str, Tensor]]],
                             dtype: torch.dtype | None = torch.bfloat16, lora_scaling: float | None = None) -> None:
    by_delta, reports = await _served_after(model_path, versions, delta_sync=True, dtype=dtype,
                                            lora_scaling=lora_scaling)
    by_full, _ = await _served_after(model_path, versions, delta_sync=False, dtype=dtype, lora_scaling=lora_scaling)
    assert [report.delta_base for report in reports] == [None, *range(len(versions) - 1)]
    assert all(report.fingerprints is not None and report.fingerprints.matched == ("rollout-0",) for report in reports)
    assert by_delta == by_full


@pytest.mark.integration
async def test_a_torch_engine_fed_deltas_serves_bit_for_bit_what_one_fed_full_pushes_serves(
        tiny_model_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    first = [(name, tensor.detach().clone()) for name, tensor in model.named_parameters()]
    await _delta_equals_full(tiny_model_path, [first, _moved(first, 1), _moved(_moved(first, 1), 2)])


@pytest.mark.integration
async def test_a_lora_merged_engine_fed_deltas_serves_what_one_fed_full_adapters_serves(tiny_model_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(5)
    adapter = []
    for module in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.up_proj"):
        out_features, in_features = model.get_parameter(f"{module}.weight").shape
        adapter += [(f"{module}.lora_A.weight", torch.randn(4, in_features, generator=generator) * 0.1),
                    (f"{module}.lora_B.weight", torch.randn(out_features, 4, generator=generator) * 0.1)]
    moved = [(name, tensor.clone()) for name, tensor in adapter]
    moved[1][1][0] += 0.5  # one row of one B factor changes: its A, unchanged, still goes with it to the merge
    await _delta_equals_full(tiny_model_path, [adapter, moved, _moved(moved, 6)], dtype=None, lora_scaling=2.0)


@pytest.mark.integration
async def test_an_moe_engine_fed_expert_slice_deltas_serves_what_one_fed_full_pushes_serves(
        tiny_model_cache: Path) -> None:
    path = cached_tiny_model(tiny_model_cache, TinyModelSpec(family="qwen3_moe", experts=8))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    to_checkpoint = layouts.CheckpointLayout(model.config)  # one tensor per expert projection, as SGLang loads
    first = [(name, tensor.clone()) for name, tensor in to_checkpoint(
        (name, parameter.detach()) for name, parameter in model.named_parameters())]
    assert sum(".experts." in name for name, _ in first) >= 8 * 3
    second = [(name, tensor + 0.05 if name.endswith("experts.3.up_proj.weight") else tensor) for name, tensor in first]
    await _delta_equals_full(path, [first, second, _moved(second, 7)])
