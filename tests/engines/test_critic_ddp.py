"""Two learner processes (gloo) each train the critic on their shard and take the same update as one process on the
whole batch: the value loss divides by the whole step's counts and the gradients are summed over the ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from engines.training import TorchTrainer, TorchTrainerConfig, TrainSample
from engines.training.config import CriticSettings
from policies.config import PolicyLossConfig
from policies.step_loss import ValueLoss
from tests.support.rendezvous import rendezvous_file
from tests.support.training import seeded_batch

WORLD = 2


def critic_batch() -> list[TrainSample]:
    """The seeded batch with a critic's inputs: values before the step (0, as a fresh head gives) and returns."""
    generator = torch.Generator().manual_seed(5)
    samples = seeded_batch()
    for sample in samples:
        sample.values = torch.zeros(sample.response_length)
        sample.returns = torch.rand(sample.response_length, generator=generator) * 2 - 1
    return samples


def value_loss() -> ValueLoss:
    samples = critic_batch()
    return ValueLoss(PolicyLossConfig(loss_agg_mode="seq-mean-token-mean"), denominator=float(len(samples)),
                     total_tokens=float(sum(int((s.loss_mask != 0).sum()) for s in samples)))


def with_critic(model_path: Path) -> TorchTrainer:
    """A trainer whose critic head is random (seeded), not zero: the update then reaches every weight."""
    trainer = TorchTrainer(config(model_path))
    with torch.no_grad():
        head = trainer._critic.model.get_output_embeddings().weight
        head.copy_(torch.randn(head.shape, generator=torch.Generator().manual_seed(3)) * 0.1)
    return trainer


def config(model_path: Path) -> TorchTrainerConfig:
    # eps 1: Adam's first step is about lr x sign(g) unless |g| << eps; with eps 1 it is proportional to g, so a tiny
    # gradient whose sign the order of summation flips moves its weight by next to nothing (as the policy's DDP test)
    return TorchTrainerConfig(model_path=model_path, lr=1e-3, eps=1.0, micro_batch_tokens=50, check_packing=False,
                              critic=CriticSettings(model_path=model_path, lr=1e-2))


def _worker(rank: int, rendezvous: str, model_path: Path, out_dir: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=WORLD)
    try:
        trainer = with_critic(model_path)
        samples = critic_batch()
        result = trainer.train_critic(samples[:5] if rank == 0 else samples[5:], value_loss())
        if rank == 0:
            critic = trainer._critic.model
            save_file({name: t.detach().contiguous() for name, t in critic.state_dict().items()},
                      str(out_dir / "critic.st"))
            (out_dir / "loss.txt").write_text(f"{result.metrics['loss']} {result.grad_norm}")
        trainer.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.integration
def test_two_ranks_take_the_critic_update_one_rank_takes_on_the_whole_batch(tiny_model_path: Path,
                                                                           tmp_path: Path) -> None:
    mp.spawn(_worker, args=(rendezvous_file(), tiny_model_path, tmp_path), nprocs=WORLD, join=True)
    single = with_critic(tiny_model_path)
    result = single.train_critic(critic_batch(), value_loss())
    loss, grad_norm = map(float, (tmp_path / "loss.txt").read_text().split())
    assert loss == pytest.approx(result.metrics["loss"], rel=1e-5)
    assert grad_norm == pytest.approx(result.grad_norm, rel=1e-5)
    ranked = load_file(str(tmp_path / "critic.st"))
    for name, tensor in single._critic.model.state_dict().items():
        torch.testing.assert_close(ranked[name], tensor, atol=1e-6, rtol=1e-5, msg=name)
