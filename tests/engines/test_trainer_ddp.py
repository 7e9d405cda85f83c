"""Two learner processes (DDP over gloo) take the same step as one process on the whole batch, training every
weight or a LoRA adapter."""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from torch import Tensor

from engines.training import ModelOutputs, PackedBatch, TorchTrainer, TorchTrainerConfig, TrainSample
from engines.training.lora import LoraSettings
from tests.support.rendezvous import rendezvous_file
from tests.support.training import seeded_batch

TEMPERATURE = 0.9
WORLD = 2
ADAPTERS = {"full": None, "lora": LoraSettings(rank=4, alpha=8.0)}


def _shard(samples: list[TrainSample], rank: int) -> list[TrainSample]:
    """Uneven on purpose: the ranks run different numbers of micro-batches."""
    return samples[:5] if rank == 0 else samples[5:]


@dataclass(frozen=True)
class StepLoss:
    """Divided by the counts of the WHOLE step (both ranks' shards), as the learner's loss is."""

    loss_tokens: int
    sequences: int

    def __call__(self, outputs: ModelOutputs, batch: PackedBatch) -> tuple[Tensor, dict]:
        assert batch.loss_mask is not None and batch.advantages is not None
        mask = batch.loss_mask
        token_term = -(batch.advantages * outputs.log_probs * mask).sum() / self.loss_tokens
        sequence_term = (outputs.log_probs * mask).sum() / self.sequences
        return token_term + 0.05 * sequence_term, {"token_term": float(token_term.detach())}


def policy_loss() -> StepLoss:
    samples = seeded_batch()
    return StepLoss(loss_tokens=sum(int((s.loss_mask != 0).sum()) for s in samples), sequences=len(samples))


def _config(model_path: Path, adapter: str) -> TorchTrainerConfig:
    return TorchTrainerConfig(model_path=model_path, lr=1e-2, eps=1.0, grad_clip=None, micro_batch_tokens=50,
                              check_packing=False, lora=ADAPTERS[adapter])


def _ddp_worker(rank: int, rendezvous: str, model_path: Path, out_dir: Path, adapter: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=WORLD)
    try:
        trainer = TorchTrainer(_config(model_path, adapter))
        result = trainer.train_step(_shard(seeded_batch(), rank), policy_loss(), temperature=TEMPERATURE)
        trainer.save_checkpoint(out_dir / "checkpoint", {"cursor": 7})  # collective: rank 0 writes
        if rank == 0:
            save_file({name: t.contiguous() for name, t in trainer.named_tensors()}, str(out_dir / "weights.st"))
            summary = {"version": result.version, "grad_norm": result.grad_norm, "metrics": result.metrics}
            (out_dir / "result.json").write_text(json.dumps(summary))
        trainer.close()
    finally:
        dist.destroy_process_group()



@pytest.fixture(scope="module", params=sorted(ADAPTERS))
def ddp_run(request: pytest.FixtureRequest, tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> tuple[Path, str]:
    """One two-process step (and a collective checkpoint) shared by the tests below: spawning costs seconds."""
    out_dir = tmp_path_factory.mktemp(f"ddp-{request.param}")
    mp.spawn(_ddp_worker, args=(rendezvous_file(), tiny_model_path, out_dir, request.param), nprocs=WORLD, join=True)
    return out_dir, request.param


@pytest.mark.integration
def test_two_process_ddp_step_equals_the_single_process_step(tiny_model_path: Path,
                                                             ddp_run: tuple[Path, str]) -> None:
    out_dir, adapter = ddp_run
    ddp = json.loads((out_dir / "result.json").read_text())
    ddp_weights = load_file(str(out_dir / "weights.st"))

    single = TorchTrainer(_config(tiny_model_path, adapter))
    result = single.train_step(seeded_batch(), policy_loss(), temperature=TEMPERATURE)

    assert ddp["version"] == result.version == 1
    assert ddp["metrics"]["sequences"] == 7
    assert ddp["grad_norm"] == pytest.approx(result.grad_norm, rel=1e-5)
    assert ddp["metrics"]["loss"] == pytest.approx(result.metrics["loss"], rel=1e-5)
    assert ddp["metrics"]["token_term"] == pytest.approx(result.metrics["token_term"], rel=1e-5)
    for name, tensor in single.named_tensors():
        torch.testing.assert_close(ddp_weights[name], tensor, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.integration
def test_checkpoint_saved_by_ddp_ranks_resumes_in_one_process(tiny_model_path: Path,
                                                              ddp_run: tuple[Path, str]) -> None:
    out_dir, adapter = ddp_run
    resumed = TorchTrainer(_config(tiny_model_path, adapter))
    assert resumed.load_checkpoint(out_dir / "checkpoint") == {"cursor": 7}
    assert resumed.version == 1
    ddp_weights = load_file(str(out_dir / "weights.st"))
    for name, tensor in resumed.named_tensors():
        assert torch.equal(tensor, ddp_weights[name]), name


def _ddp_init_before_torch_2_13(self, module, device_ids=None, output_device=None, dim=0, broadcast_buffers=True,
                                init_sync=True, process_group=None, bucket_cap_mb=None, find_unused_parameters=False,
                                check_reduction=False, gradient_as_bucket_view=False, static_graph=False,
                                delay_all_reduce_named_params=None, param_to_hook_all_reduce=None,
                                mixed_precision=None, device_mesh=None, skip_all_reduce_unused_params=False):
    """DistributedDataParallel.__init__ as torch releases before 2.13 declare it (2.11 is the GPU image's torch)."""


@pytest.mark.unit
def test_buffer_sync_is_switched_off_by_the_name_the_installed_torch_knows() -> None:
    # The first two-rank learner on a GPU machine (torch 2.11) died on `forward_sync_buffers`, a 2.13 name.
    from engines.training.data_parallel import ddp_buffer_sync_off

    assert ddp_buffer_sync_off(_ddp_init_before_torch_2_13) == {"broadcast_buffers": False}
    # The installed torch: 2.13 (CI's pin) says forward_sync_buffers; the GPU image's 2.11 says broadcast_buffers.
    installed = inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
    expected = "forward_sync_buffers" if "forward_sync_buffers" in installed else "broadcast_buffers"
    assert ddp_buffer_sync_off() == {expected: False}
