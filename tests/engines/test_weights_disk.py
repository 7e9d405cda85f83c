"""Weight pushes through a shared folder (`--weight-transport disk`, slime's `--update-weight-transport disk`): a torch
engine fed through the folder serves bit for bit what one fed over gloo serves; the post-write hook sees every file
before any engine reads; the folders go unless kept; a file the engine cannot read fails the push, naming the engine,
and the next push repairs it; an SGLang(-compatible) server reloads each push with `/update_weights_from_disk`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
import torch
from safetensors import safe_open
from torch import Tensor
from transformers import AutoModelForCausalLM

from engines.inference.base import GenerateRequest, SamplingParams
from engines.inference.torch_engine import TorchEngine
from engines.sglang.client import SglangEngine
from engines.sglang.disk_weights import SglangDiskLoader, SglangDiskSender
from engines.sglang.launch import ServerProcess, ServerSpec
from engines.weights import disk_files
from engines.weights.base import REPAIR, TransferReport, WeightTransferError
from engines.weights.names import DISK, TORCH_DISTRIBUTED
from engines.weights.transport import DiskOptions, SenderOptions, resolve_transport

pytestmark = pytest.mark.integration
ENGINE = "rollout-0"


def _moved(model_path: Path, seed: int) -> list[tuple[str, Tensor]]:
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    return [(name, tensor.detach() + torch.randn(tensor.shape, generator=generator) * 1e-2)
            for name, tensor in model.named_parameters()]


async def _push(model_path: Path, transport: str, versions: list[list[tuple[str, Tensor]]], *,
                disk: DiskOptions | None = None, delta_sync: bool = False,
                ) -> tuple[dict[str, bytes], list[TransferReport | WeightTransferError]]:
    """Each version in turn into a torch engine on the tiny model, checked; what it serves after, and each outcome."""
    mechanism = resolve_transport(transport)
    sender = mechanism.make_sender(SenderOptions(host="127.0.0.1", backend="disk" if disk else "gloo",
                                                 timeout_s=30.0, bucket_bytes=64 * 1024, disk=disk,
                                                 delta_sync=delta_sync, delta_backoff=0))
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    outcomes: list[TransferReport | WeightTransferError] = []
    async with TorchEngine(model, None) as engine:
        loader = mechanism.make_loader(engine, ENGINE, structlog.get_logger())
        group = None
        try:
            for version, named in enumerate(versions, start=1):
                fresh = group is None
                group = group or sender.open_group(["learner", ENGINE]).to_dict()
                loading = asyncio.create_task(loader.apply(group, version, 30.0))
                if fresh:
                    await asyncio.to_thread(sender.wait_for_receivers)
                try:
                    outcomes.append(await asyncio.to_thread(sender.send, iter(named), version, dtype=torch.bfloat16,
                                                            fingerprint=True))
                except WeightTransferError as error:
                    outcomes.append(error)
                    group = None  # the learner forms a new generation after a failed push
                await asyncio.gather(loading, return_exceptions=True)
        finally:
            loader.close()
            sender.close()
    served = {name: tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
              for name, tensor in model.state_dict().items()}
    return served, outcomes


async def test_a_push_through_the_folder_serves_bit_for_bit_what_a_push_over_gloo_serves(
        tiny_model_path: Path, tmp_path: Path) -> None:
    versions = [_moved(tiny_model_path, 1), _moved(tiny_model_path, 2)]
    over_gloo, gloo_reports = await _push(tiny_model_path, TORCH_DISTRIBUTED, versions)
    through_disk, disk_reports = await _push(tiny_model_path, DISK, versions,
                                             disk=DiskOptions(directory=str(tmp_path / "pushes")))
    assert all(isinstance(report, TransferReport) and report.fingerprints is not None and report.fingerprints.ok
               for report in [*gloo_reports, *disk_reports])
    assert through_disk == over_gloo
    assert list((tmp_path / "pushes").iterdir()) == []  # no version's folder outlives its push


async def test_the_hook_sees_every_file_before_the_engine_reads_and_kept_folders_are_checkpoints(
        tiny_model_path: Path, tmp_path: Path) -> None:
    seen: list[tuple[str, tuple[str, ...], list[str]]] = []

    def post_write(folder: str, engines: tuple[str, ...]) -> None:
        seen.append((folder, engines, sorted(path.name for path in Path(folder).iterdir())))

    versions = [_moved(tiny_model_path, 3), _moved(tiny_model_path, 4)]
    disk = DiskOptions(directory=str(tmp_path / "pushes"), keep_files=True, post_write=post_write,
                       local_directory=str(tmp_path / "local"))
    _, reports = await _push(tiny_model_path, DISK, versions, disk=disk, delta_sync=True)
    assert [report.delta_base for report in reports if isinstance(report, TransferReport)] == [None, 1]
    first = tmp_path / "pushes" / "weight_v000001"
    assert [folder for folder, _, _ in seen] == [str(first), str(tmp_path / "pushes" / "weight_v000002")]
    assert all(engines == (ENGINE,) for _, engines, _ in seen)
    assert disk_files.INDEX in seen[0][2] and disk_files.MANIFEST in seen[0][2]
    assert not any(name.endswith(".tmp") for _, _, names in seen for name in names)
    # A kept full push is a checkpoint under our names, in the push dtype.
    weight_map = json.loads((first / disk_files.INDEX).read_text())["weight_map"]
    assert set(weight_map) == {name for name, _ in versions[0]}
    name, tensor = versions[0][0]
    with safe_open(str(first / weight_map[name]), framework="pt") as handle:
        assert torch.equal(handle.get_tensor(name), tensor.to(torch.bfloat16))
    assert sorted(path.name for path in (tmp_path / "local" / ENGINE).iterdir()) == seen[1][2]  # the last copy


async def test_a_file_the_engine_cannot_read_fails_the_push_naming_it_and_the_next_push_repairs(
        tiny_model_path: Path, tmp_path: Path) -> None:
    def lose_a_file_of_version_2(folder: str, engines: tuple[str, ...]) -> None:
        if folder.endswith("weight_v000002"):
            next(Path(folder).glob("*.safetensors")).unlink()

    versions = [_moved(tiny_model_path, 5), _moved(tiny_model_path, 6), _moved(tiny_model_path, 7)]
    disk = DiskOptions(directory=str(tmp_path), post_write=lose_a_file_of_version_2)
    served, outcomes = await _push(tiny_model_path, DISK, versions, disk=disk, delta_sync=True)
    assert isinstance(outcomes[1], WeightTransferError) and ENGINE in outcomes[1].failed
    assert "is missing" in outcomes[1].failed[ENGINE]
    repair = outcomes[2]
    assert isinstance(repair, TransferReport) and repair.delta_base is None and repair.fingerprints.ok
    expected, _ = await _push(tiny_model_path, TORCH_DISTRIBUTED, versions[2:])
    assert served == expected


def test_a_folder_that_cannot_be_made_is_refused_naming_it(tmp_path: Path) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with pytest.raises(ValueError, match=r"weight disk folder .*a-file/pushes.*cannot be created"):
        resolve_transport(DISK).make_sender(SenderOptions(host="127.0.0.1", backend="disk", timeout_s=5.0,
                                                          disk=DiskOptions(directory=str(blocked / "pushes"))))


# ------------------------------------------------------------------------------------------------ SGLang
@pytest.fixture(scope="module")
def server(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    spec = ServerSpec(model_path=str(tiny_model_path), module="tools.standins.sglang_server",
                      extra={"torch-threads": "1"})
    process = ServerProcess(spec, startup_timeout=120, log_dir=tmp_path_factory.mktemp("sglang-logs"))
    process.start()
    yield process
    process.stop()


async def test_an_sglang_server_reloads_each_push_from_the_folder_and_the_check_certifies_it(
        server: ServerProcess, tiny_model_path: Path, tmp_path: Path) -> None:
    client = SglangEngine(server.url)
    sender = SglangDiskSender(directory=tmp_path, bucket_bytes=64 * 1024, timeout_s=20)
    loader = SglangDiskLoader(client, ENGINE)
    reference = TorchEngine.from_pretrained(tiny_model_path)
    greedy = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    try:
        group = sender.open_group(["learner", ENGINE]).to_dict()
        assert group["transport"] == "sglang_disk" and group["directory"] == str(tmp_path)
        for version in (1, 2):
            named = _moved(tiny_model_path, 10 + version)
            loading = asyncio.create_task(loader.apply(group, version, 20.0))
            if version == 1:
                await asyncio.to_thread(sender.wait_for_receivers)
            report = await asyncio.to_thread(sender.send, iter(named), version, fingerprint=True)
            await loading
            assert report.fingerprints is not None and report.fingerprints.ok, report.fingerprints
            assert client.version == version and await client.server_weight_version() == version
            assert list(tmp_path.iterdir()) == []
        await reference.update_weights(named, 2)
        expected = (await reference.generate(GenerateRequest("ref", [7, 21, 33, 4], greedy)))[0]
        served = (await client.generate(GenerateRequest("after", [7, 21, 33, 4], greedy)))[0]
        assert served.output_ids == expected.output_ids and served.versions == [2] * len(served.output_ids)
    finally:
        sender.close()
        await reference.close()
        await client.close()


def _sparsely_moved(model_path: Path, seed: int, fraction: float = 0.05) -> list[tuple[str, Tensor]]:
    """The tiny model with `fraction` of each matrix's elements moved (its norms as they are): the sparse change of
    a bfloat16 push between two versions of full fine-tuning (docs/reliability.md)."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    moved = []
    for name, tensor in model.named_parameters():
        if tensor.dim() >= 2:
            mask = torch.rand(tensor.shape, generator=generator) < fraction
            tensor = tensor.detach() + mask * (0.05 + torch.rand(tensor.shape, generator=generator))
        moved.append((name, tensor.detach()))
    return moved


class _ServerPushes:
    """A learner's sender and a rollout worker's loader of one server, pushing versions in turn (checked, bfloat16);
    a failed push forms a new group, as the learner does."""

    def __init__(self, client: SglangEngine, sender: SglangDiskSender) -> None:
        self.loader, self.sender = SglangDiskLoader(client, ENGINE), sender
        self.group: dict | None = None

    async def push(self, versions: dict[int, list[tuple[str, Tensor]]]) -> list[TransferReport | WeightTransferError]:
        outcomes: list[TransferReport | WeightTransferError] = []
        for version, named in versions.items():
            fresh = self.group is None
            self.group = self.group or self.sender.open_group(["learner", ENGINE]).to_dict()
            loading = asyncio.create_task(self.loader.apply(self.group, version, 20.0))
            if fresh:
                await asyncio.to_thread(self.sender.wait_for_receivers)
            try:
                outcomes.append(await asyncio.to_thread(self.sender.send, iter(named), version, dtype=torch.bfloat16,
                                                        fingerprint=True))
            except WeightTransferError as error:
                outcomes.append(error)
                self.group = None
            await asyncio.gather(loading, return_exceptions=True)
        return outcomes


def _delta_sender(tmp_path: Path) -> SglangDiskSender:
    """A learner's sender of delta pushes through `tmp_path/pushes`; each engine's checkpoint in `tmp_path/local`."""
    return SglangDiskSender(directory=tmp_path / "pushes", bucket_bytes=64 * 1024, timeout_s=20,
                            local_directory=str(tmp_path / "local"), delta_sync=True, delta_backoff=0)


async def test_delta_pushes_to_an_sglang_server_end_where_a_full_push_does_bit_for_bit(
        server: ServerProcess, tiny_model_path: Path, tmp_path: Path) -> None:
    client, sender, local = SglangEngine(server.url), _delta_sender(tmp_path), tmp_path / "local"
    versions = {version: _sparsely_moved(tiny_model_path, 20 + version) for version in range(1, 5)}
    try:
        reports = await _ServerPushes(client, sender).push(versions)
        assert all(isinstance(report, TransferReport) and report.fingerprints.ok for report in reports), reports
        assert [report.delta_base for report in reports] == [None, 1, 2, 3]
        full = reports[0].num_bytes
        print("\nSGLang disk push bytes, tiny model, bfloat16, 5% of matrix elements moved: full "
              f"{full}, deltas {[report.num_bytes for report in reports[1:]]}")
        assert all(report.num_bytes < full / 3 and report.full_bytes == full for report in reports[1:])
        after_deltas = await client.weight_checksum()
        assert await client.server_weight_version() == 4
        # The same weights pushed whole by a sender without delta sync: the server serves the same bits.
        whole = SglangDiskSender(directory=tmp_path / "whole", bucket_bytes=64 * 1024, timeout_s=20)
        try:
            [report] = await _ServerPushes(client, whole).push({5: versions[4]})
        finally:
            whole.close()
        assert isinstance(report, TransferReport) and report.delta_base is None
        after_full = await client.weight_checksum()
        assert after_deltas is not None and after_full is not None
        assert after_deltas.tensors == after_full.tensors and after_deltas.engine == after_full.engine
        # ... and the local checkpoint the deltas were written into holds version 4 as pushed
        weight_map = json.loads((local / ENGINE / disk_files.INDEX).read_text())["weight_map"]
        for name, tensor in versions[4]:
            with safe_open(str(local / ENGINE / weight_map[name]), framework="pt") as handle:
                stored = handle.get_tensor(name).view(torch.int16)
                assert torch.equal(stored, tensor.to(torch.bfloat16).view(torch.int16))
    finally:
        sender.close()
        await client.close()


async def test_a_damaged_local_checkpoint_fails_the_delta_before_the_server_reloads_and_the_next_push_repairs_it(
        server: ServerProcess, tiny_model_path: Path, tmp_path: Path) -> None:
    client, sender, local = SglangEngine(server.url), _delta_sender(tmp_path), tmp_path / "local"
    versions = {version: _sparsely_moved(tiny_model_path, 30 + version) for version in range(1, 5)}
    try:
        pushes = _ServerPushes(client, sender)
        reports = await pushes.push({1: versions[1], 2: versions[2]})
        assert [report.delta_base for report in reports] == [None, 1]
        before = await client.weight_checksum()
        # A norm (which no version moves, so no delta overwrites it) damaged on the engine's disk.
        weight_map = json.loads((local / ENGINE / disk_files.INDEX).read_text())["weight_map"]
        damaged = "model.norm.weight"
        shard = local / ENGINE / weight_map[damaged]
        with safe_open(str(shard), framework="pt") as handle:
            stored = handle.get_tensor(damaged).clone()  # not a view of the file damaged below
        raw = bytearray(shard.read_bytes())
        header_bytes = int.from_bytes(raw[:8], "little")
        position = 8 + header_bytes + json.loads(raw[8:8 + header_bytes])[damaged]["data_offsets"][0]
        raw[position] ^= 0xFF
        shard.write_bytes(bytes(raw))
        [refused] = await pushes.push({3: versions[3]})
        assert isinstance(refused, WeightTransferError) and ENGINE in refused.failed
        assert "differs from the learner's weights in 1 tensor(s), e.g. model.norm.weight" in refused.failed[ENGINE]
        # Refused before the server reloaded anything: it still serves version 2.
        assert await client.server_weight_version() == 2 and await client.weight_checksum() == before
        [repair] = await pushes.push({4: versions[4]})
        assert isinstance(repair, TransferReport) and repair.delta_base is None and repair.fingerprints.ok
        assert repair.full_because is not None and repair.full_because.startswith(REPAIR)
        assert await client.server_weight_version() == 4
        with safe_open(str(shard), framework="pt") as handle:
            assert torch.equal(handle.get_tensor(damaged), stored)
    finally:
        sender.close()
        await client.close()
