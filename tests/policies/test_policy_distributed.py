"""Advantage whitening across data-parallel ranks, with real processes and a real gloo process group."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from policies.advantages import compute_advantages
from policies.config import PolicyLossConfig
from tests.support.rendezvous import rendezvous_file

WORLD_SIZE = 2


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    lengths = torch.tensor([3, 1, 5, 2, 4, 6])  # rank 0 gets samples 0-1 (4 tokens), rank 1 samples 2-5
    total = int(lengths.sum())
    return {
        "rewards": torch.randn(6, generator=gen, dtype=torch.float64),
        "group_ids": torch.tensor([0, 0, 0, 1, 1, 1]),
        "response_lengths": lengths,
        "loss_mask": (torch.rand(total, generator=gen) > 0.2).double(),
    }


def _shard(batch: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    samples = slice(0, 2) if rank == 0 else slice(2, 6)
    offsets = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), batch["response_lengths"]]), 0)
    tokens = slice(int(offsets[samples.start]), int(offsets[samples.stop]))
    return {
        "rewards": batch["rewards"][samples],
        "group_ids": batch["group_ids"][samples],
        "response_lengths": batch["response_lengths"][samples],
        "loss_mask": batch["loss_mask"][tokens],
    }


def _worker(rank: int, rendezvous: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=WORLD_SIZE)
    try:
        # rewards are already normalised upstream here; only the batch whitening spans ranks
        config = PolicyLossConfig(rewards_normalization=False, normalize_advantages=True)
        advantages, _ = compute_advantages(config, process_group=dist.group.WORLD, **_shard(_batch(), rank))
        torch.save(advantages, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.integration
def test_whitening_across_ranks_equals_whitening_the_whole_batch(tmp_path: Path) -> None:
    # spawn, not fork: forking a pytest process that already runs worker threads (asyncio, gloo) can deadlock
    mp.spawn(_worker, args=(rendezvous_file(), str(tmp_path)), nprocs=WORLD_SIZE, join=True)
    sharded = torch.cat([torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD_SIZE)])
    config = PolicyLossConfig(rewards_normalization=False, normalize_advantages=True)
    whole, _ = compute_advantages(config, **_batch())
    torch.testing.assert_close(sharded, whole, rtol=1e-12, atol=1e-12)
    local_only, _ = compute_advantages(config, **_shard(_batch(), 0))
    assert not torch.allclose(local_only, whole[: local_only.numel()])  # the ranks really did share statistics
