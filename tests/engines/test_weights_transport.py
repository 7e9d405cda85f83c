"""The weight-transport registry: built-ins and plugins by name, a real torch_distributed push through it into a
torch engine, the rollout worker's loader chosen by the order's transport name, and no torch where none is used."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
import torch
from structlog.testing import capture_logs
from transformers import AutoModelForCausalLM

from actors.config import RunConfig
from actors.learner.publish import sender_options, transfer_backend, transport_name
from actors.learner.ranks import CollectiveTrainer, LearnerRanks
from actors.rollout.engine_factory import lora_server_args
from actors.rollout.weights import EngineWeightReceiver
from bus.schema import WeightUpdateOrder
from engines.inference.torch_engine import TorchEngine
from engines.training.config import TorchTrainerConfig
from engines.training.torch_trainer import TorchTrainer
from engines.weights.manifest import TensorSpec, plan_buckets
from engines.weights.torch_distributed import DEFAULT_BUCKET_BYTES, DEFAULT_DIRECT_BYTES
from engines.weights.transport import SenderOptions, WeightTransport, resolve_transport

ROOT = Path(__file__).resolve().parents[2]

PLUGIN_MODULE = '''
from engines.weights.transport import WeightTransport

APPLIED = []


class RecordingLoader:
    """A loader that keeps what it was asked to apply, so a test can see which loader an order reached."""

    def __init__(self, engine, actor_id, log):
        self.actor_id = actor_id

    async def apply(self, group, version, timeout_s):
        APPLIED.append((self.actor_id, dict(group), version))

    def close(self):
        pass


def no_sender(options):
    raise RuntimeError("this plugin has no learner side")


class SlowToBuildLoader(RecordingLoader):
    """Stands for a loader whose first build imports torch into a worker that never needed it: seconds."""

    def __init__(self, engine, actor_id, log):
        import time

        time.sleep(1.0)
        super().__init__(engine, actor_id, log)


TRANSPORT = WeightTransport("my-transport", no_sender, RecordingLoader)
SLOW_TO_BUILD = WeightTransport("slow", no_sender, SlowToBuildLoader)
NOT_A_TRANSPORT = {"name": "my-transport"}
'''


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    (tmp_path / "weights_plugin_for_test.py").write_text(PLUGIN_MODULE, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "weights_plugin_for_test"
    sys.modules.pop("weights_plugin_for_test", None)


@pytest.mark.unit
def test_built_in_names_resolve_to_their_transports() -> None:
    assert resolve_transport("torch_distributed").name == "torch_distributed"
    assert resolve_transport("sglang").name == "sglang"


@pytest.mark.unit
def test_unknown_built_in_name_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"'nccl'.*torch_distributed"):
        resolve_transport("nccl")


@pytest.mark.unit
def test_plugin_path_resolves_and_is_named_by_its_path(plugin: str) -> None:
    transport = resolve_transport(f"{plugin}:TRANSPORT")
    assert isinstance(transport, WeightTransport)
    assert transport.name == f"{plugin}:TRANSPORT"  # what engines receive and resolve again
    assert transport.make_loader.__name__ == "RecordingLoader"


@pytest.mark.unit
def test_plugin_path_to_something_else_is_a_type_error_naming_the_path(plugin: str) -> None:
    with pytest.raises(TypeError, match=f"'{plugin}:NOT_A_TRANSPORT'.*got dict"):
        resolve_transport(f"{plugin}:NOT_A_TRANSPORT")


def record_post_write(args: object, version_dir: str, engines: list[str]) -> None:
    """A slime post-write hook (`--custom-update-weight-post-write-path`), for the test below."""
    POST_WRITES.append((args, version_dir, engines))


POST_WRITES: list[tuple[object, str, list[str]]] = []


@pytest.mark.unit
def test_a_disk_run_picks_each_engines_folder_mechanism_and_hands_the_sender_slimes_hook(tmp_path: Path) -> None:
    disk = {"weight_transport": "disk", "weight_disk_dir": str(tmp_path), "weight_disk_keep_files": True,
            "weight_disk_post_write_path": f"{__name__}:record_post_write"}
    assert transport_name(RunConfig(**disk)) == "disk"
    assert transport_name(RunConfig(rollout_engine="sglang", **disk)) == "sglang_disk"
    assert transport_name(RunConfig(rollout_engine="sglang", colocate=True, **disk)) == "sglang_disk"
    assert transfer_backend(RunConfig(**disk)) == "disk"
    options = sender_options(RunConfig(**disk, custom_config={"bucket": "b"}), "127.0.0.1")
    assert options.disk is not None and options.disk.directory == str(tmp_path) and options.disk.keep_files
    options.disk.post_write(str(tmp_path / "weight_v000003"), ("rollout-0", "rollout-1"))
    args, folder, engines = POST_WRITES[-1]
    assert (folder, engines) == (str(tmp_path / "weight_v000003"), ["rollout-0", "rollout-1"])
    assert (args.update_weight_disk_dir, args.bucket) == (str(tmp_path), "b")  # slime's names; the custom config
    assert sender_options(RunConfig(), "127.0.0.1").disk is None


@pytest.mark.unit
def test_run_config_chooses_the_mechanism_once() -> None:
    assert transport_name(RunConfig()) == "torch_distributed"
    assert transport_name(RunConfig(rollout_engine="sglang", weight_transport="nccl")) == "sglang"
    # a LoRA run's adapter goes to SGLang by name (engines/sglang/adapter_sync.py), to a torch engine as tensors
    assert transport_name(RunConfig(rollout_engine="sglang", lora_rank=8)) == "sglang_lora"
    assert transport_name(RunConfig(lora_rank=8)) == "torch_distributed"
    assert transport_name(RunConfig(weight_transport="pkg.mod:TRANSPORT")) == "pkg.mod:TRANSPORT"
    assert transfer_backend(RunConfig(weight_transport="cuda_ipc")) == "cuda_ipc"
    expected = "nccl" if torch.cuda.is_available() else "gloo"
    assert transfer_backend(RunConfig()) == expected
    assert transfer_backend(RunConfig(weight_transport="pkg.mod:TRANSPORT")) == expected


@pytest.mark.unit
def test_a_lora_run_on_sglang_adapts_only_modules_sglang_can_and_launches_its_servers_with_room_for_them() -> None:
    with pytest.raises(ValueError, match=r"--target-modules with --rollout-engine sglang: .*\['fc_in'\]"):
        RunConfig(rollout_engine="sglang", lora_rank=8, target_modules=["q_proj", "fc_in"])
    RunConfig(lora_rank=8, target_modules=["fc_in"])  # the torch engine merges any linear layer
    assert lora_server_args(RunConfig(rollout_engine="sglang", lora_rank=16)) == {
        "enable-lora": "true", "max-lora-rank": "16", "lora-target-modules": ["all"]}
    run = RunConfig(rollout_engine="sglang", lora_rank=4, target_modules=["q_proj", "v_proj"])
    assert lora_server_args(run)["lora-target-modules"] == ["q_proj", "v_proj"]


@pytest.mark.unit
@pytest.mark.parametrize("name", ["sglang", "sglang_tensor"])
def test_sglang_senders_take_the_runs_bucket_size_and_keep_slimes_default(name: str) -> None:
    """One HTTP call or broadcast per bucket, as slime's --update-weight-buffer-size sizes them (512 MiB)."""
    options = SenderOptions(host="127.0.0.1", backend="gloo", timeout_s=5.0)
    assert resolve_transport(name).make_sender(options).bucket_bytes == 512 * 1024 * 1024
    sized = dataclasses.replace(options, bucket_bytes=64 * 1024 * 1024)
    assert resolve_transport(name).make_sender(sized).bucket_bytes == 64 * 1024 * 1024


@pytest.mark.unit
def test_weight_transport_setting_refuses_a_name_that_is_neither_backend_nor_path() -> None:
    with pytest.raises(ValueError, match="'ncl'"):
        RunConfig(weight_transport="ncl")


def _perturbed(model: torch.nn.Module, seed: int) -> list[tuple[str, torch.Tensor]]:
    """New values for every parameter (tied ones once, as a trainer sends them)."""
    generator = torch.Generator().manual_seed(seed)
    return [
        (name, tensor.detach() + torch.randn(tensor.shape, generator=generator) * 0.05)
        for name, tensor in model.named_parameters()
    ]


@pytest.mark.integration
@pytest.mark.parametrize("bucket_bytes", [None, 4096])
async def test_torch_distributed_transport_lands_new_weights_in_a_torch_engine(tiny_model_path: Path,
                                                                             bucket_bytes: int | None) -> None:
    """Also with the run's bucket size (--weight-bucket-bytes, slime's --update-weight-buffer-size): a push then
    coalesces its small tensors into buckets of at most that many bytes."""
    transport = resolve_transport("torch_distributed")
    options = sender_options(RunConfig(weight_bucket_bytes=bucket_bytes), "127.0.0.1")
    sender = transport.make_sender(dataclasses.replace(options, backend="gloo", timeout_s=30.0))
    assert sender.bucket_bytes == (bucket_bytes or DEFAULT_BUCKET_BYTES)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    pushed = _perturbed(model, seed=3)
    try:
        async with TorchEngine(model, None) as engine:
            loader = transport.make_loader(engine, "rollout-0", structlog.get_logger())
            group = sender.open_group(["learner", "rollout-0"]).to_dict()
            assert group["transport"] == "torch_distributed"
            with capture_logs() as logs:
                loading = asyncio.create_task(loader.apply(group, 7, 30.0))
                await asyncio.to_thread(sender.wait_for_receivers)
                # A generator, as the learner hands it over: the sender iterates it once.
                report = await asyncio.to_thread(sender.send, (item for item in pushed), 7)
                await loading
            loader.close()
            assert sender.committed_version == 7 and report.num_tensors == len(pushed)
            specs = [TensorSpec(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in pushed]
            assert report.num_buckets == len(plan_buckets(specs, sender.bucket_bytes, DEFAULT_DIRECT_BYTES))
            assert (await engine.health())["version"] == 7
            live = model.state_dict()
            for name, tensor in pushed:
                assert torch.equal(live[name], tensor), name
            assert [entry["version"] for entry in logs if entry["event"] == "weights loaded"] == [7]
    finally:
        sender.close()


@pytest.mark.integration
async def test_rollout_receiver_picks_the_loader_the_order_names(plugin: str) -> None:
    path = f"{plugin}:TRANSPORT"
    receiver = EngineWeightReceiver(object(), actor_id="rollout-0", log=structlog.get_logger(), plugin=path)
    await receiver.apply(WeightUpdateOrder(version=4, group={"transport": path, "x": 1}, timeout_s=5.0))
    applied = sys.modules[plugin].APPLIED
    assert applied == [("rollout-0", {"transport": path, "x": 1}, 4)]
    receiver.close()


@pytest.mark.integration
async def test_building_a_loader_never_blocks_the_workers_event_loop(plugin: str) -> None:
    """A blocked loop sends no heartbeat: a worker importing torch for its first weight order on a busy machine
    was declared dead by the controller (2.7 s of silence) and its push failed."""
    path = f"{plugin}:SLOW_TO_BUILD"
    receiver = EngineWeightReceiver(object(), actor_id="rollout-0", log=structlog.get_logger(), plugin=path)
    loop = asyncio.get_running_loop()
    last_tick, gaps = [loop.time()], [0.0]

    async def tick() -> None:
        while True:
            await asyncio.sleep(0.01)
            gaps.append(loop.time() - last_tick[0])
            last_tick[0] = loop.time()

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.05)
    await receiver.apply(WeightUpdateOrder(version=1, group={"transport": path}, timeout_s=5.0))
    gaps.append(loop.time() - last_tick[0])
    ticker.cancel()
    applied = sys.modules[plugin].APPLIED
    assert applied == [("rollout-0", {"transport": path}, 1)]
    assert max(gaps) < 0.5, f"the event loop stalled for {max(gaps):.2f} s while the loader was built"
    receiver.close()


@pytest.mark.unit
async def test_rollout_receiver_refuses_a_plugin_it_was_not_configured_with(plugin: str) -> None:
    receiver = EngineWeightReceiver(object(), actor_id="rollout-0", log=structlog.get_logger(), plugin="auto")
    order = WeightUpdateOrder(version=4, group={"transport": f"{plugin}:TRANSPORT"}, timeout_s=5.0)
    with pytest.raises(ValueError, match=r"version 4: transport .*TRANSPORT.* not one this worker accepts"):
        await receiver.apply(order)
    assert plugin not in sys.modules  # refused before anything was imported


class UngatedTrainer(TorchTrainer):
    """A trainer that does not hold its writes for a push (as a multi-rank or Megatron one)."""

    @property
    def gates_updates(self) -> bool:
        return False


@pytest.mark.integration
@pytest.mark.parametrize(("kind", "locked"), [(UngatedTrainer, True), (TorchTrainer, False)])
def test_learner_tensors_stream_under_the_ranks_lock_unless_the_trainer_gates_its_writes(
        kind: type[TorchTrainer], locked: bool, tiny_model_path: Path, tmp_path: Path) -> None:
    """Without the gate no other operation may interleave while the sender consumes. A gating trainer streams
    without the lock: a push reads while the next step runs, and the step's write waits for the read instead."""
    trainer = kind(TorchTrainerConfig(model_path=str(tiny_model_path), lr=1e-2))
    ranks = LearnerRanks(RunConfig(), tmp_path, "127.0.0.1", structlog.get_logger())
    collective = CollectiveTrainer(trainer, ranks)
    tensors = collective.named_tensors()
    name, first = next(tensors)
    assert ranks._lock.locked() is locked
    assert first.data_ptr() == dict(trainer.named_tensors())[name].data_ptr()  # the live tensor, not a copy
    tensors.close()
    assert not ranks._lock.locked()
    assert len(list(collective.named_tensors())) == len(list(trainer.named_tensors()))
    assert not ranks._lock.locked()


@pytest.mark.unit
def test_transport_registry_and_rollout_receiver_import_without_torch() -> None:
    script = textwrap.dedent(
        """
        import sys
        import engines.weights.transport, actors.rollout.weights
        engines.weights.transport.resolve_transport("sglang")
        print("torch" in sys.modules)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == "False", result.stderr
