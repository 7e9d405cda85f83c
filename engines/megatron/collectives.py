"""The Megatron trainer's own collectives over the default group (megatron's are inside megatron).

Every tensor handed to a collective here is created on, or moved to, `parallel.world_collective_device()`: the
CPU under gloo, the model's GPU under NCCL, which has no CPU path (see `engines.megatron.parallel`). Pickled
objects go through torch's object collectives, which stage them on the right device themselves.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from engines.megatron import parallel
from engines.training import checkpoint


def sum_over_world(values: Tensor) -> Tensor:
    """`values` summed over every rank, returned on `values`' device (reduced on the collective device)."""
    if dist.get_world_size() == 1:
        return values
    staged = values.to(parallel.world_collective_device())
    dist.all_reduce(staged)
    return staged.to(values.device)


def gather_objects(mine: object) -> list[object]:
    """Every rank's `mine` (picklable), in rank order, on every rank."""
    gathered: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


def any_rank_failed(failure: BaseException | None) -> bool:
    """Whether any rank passed a failure (every rank must call it)."""
    flag = torch.tensor([int(failure is not None)], device=parallel.world_collective_device())
    dist.all_reduce(flag)
    return bool(flag.item())


def on_all_ranks_atomically(target: Path, write: Callable[[Path], None]) -> None:
    """All ranks write into one staging directory that rank 0 renames into place once everyone finished; a
    failure anywhere raises on every rank and leaves any previous checkpoint under `target` untouched."""
    rank = dist.get_rank()
    names = [f".{target.name}.staging-{uuid.uuid4().hex[:12]}"]
    dist.broadcast_object_list(names, src=0)
    staging = target.parent / names[0]
    failure: BaseException | None = None
    try:
        if rank == 0:
            staging.mkdir(parents=True)
        dist.barrier()
        write(staging)
    except Exception as error:  # re-raised below, after every rank heard about it
        failure = error
    if any_rank_failed(failure) is False and rank == 0:
        try:
            checkpoint.publish_directory(staging, target)
        except Exception as error:
            failure = error
    failed = any_rank_failed(failure)
    if rank == 0 and failed:
        shutil.rmtree(staging, ignore_errors=True)
    if failure is not None:
        raise failure
    if failed:
        raise RuntimeError(f"writing checkpoint {target} failed on another rank")


def on_rank_zero(write: Callable[[], None], what: str) -> None:
    """Run `write` on rank 0 only; a failure there raises on every rank."""
    failure: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            write()
        except Exception as error:  # re-raised below, after the other ranks heard about it
            failure = error
    if any_rank_failed(failure) and failure is None:
        raise RuntimeError(f"{what} failed on rank 0")
    if failure is not None:
        raise failure
