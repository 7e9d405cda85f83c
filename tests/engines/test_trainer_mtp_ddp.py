"""Two learner processes (gloo) each train the MTP layers on their shard and take the update one process takes on
the whole batch: the MTP loss divides by the whole step's trained tokens and its gradients are summed over the
ranks (they live outside the policy's DDP wrapper)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from engines.training import TorchTrainer, TorchTrainerConfig
from engines.training.config import MtpSettings
from tests.support.rendezvous import rendezvous_file
from tests.support.training import seeded_batch, step_loss

WORLD = 2


def trainer(model_path: Path) -> TorchTrainer:
    # eps 1 keeps Adam's first update proportional to the gradient (see test_critic_ddp.py)
    return TorchTrainer(TorchTrainerConfig(model_path=model_path, lr=1e-3, eps=1.0, micro_batch_tokens=50,
                                           check_packing=False, mtp=MtpSettings(num_layers=1)))


def _worker(rank: int, rendezvous: str, model_path: Path, out_dir: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=WORLD)
    try:
        ranked = trainer(model_path)
        samples = seeded_batch()
        result = ranked.train_step(samples[:4] if rank == 0 else samples[4:], step_loss(samples), temperature=1.0,
                                   with_entropy=True)
        if rank == 0:
            save_file(ranked._mtp.state_dict(), str(out_dir / "mtp.st"))
            (out_dir / "loss.txt").write_text(f"{result.metrics['mtp_loss']} {result.grad_norm}")
        ranked.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.integration
def test_two_ranks_take_the_mtp_update_one_rank_takes_on_the_whole_batch(tiny_model_path: Path,
                                                                        tmp_path: Path) -> None:
    mp.spawn(_worker, args=(rendezvous_file(), tiny_model_path, tmp_path), nprocs=WORLD, join=True)
    single = trainer(tiny_model_path)
    samples = seeded_batch()
    result = single.train_step(samples, step_loss(samples), temperature=1.0, with_entropy=True)
    mtp_loss, grad_norm = map(float, (tmp_path / "loss.txt").read_text().split())
    assert mtp_loss == pytest.approx(result.metrics["mtp_loss"], rel=1e-5)
    assert grad_norm == pytest.approx(result.grad_norm, rel=1e-5)
    ranked = load_file(str(tmp_path / "mtp.st"))
    for name, tensor in single._mtp.state_dict().items():
        torch.testing.assert_close(ranked[name], tensor, atol=1e-6, rtol=1e-5, msg=name)
