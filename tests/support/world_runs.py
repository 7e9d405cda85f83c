"""Parallel layouts run in gloo ranks on CPU, one world per world size rather than one per layout.

Starting ranks and importing megatron in each costs more than a tiny model's step, so the parity tests run every
layout of a world in the same ranks, one after another; each trainer builds and tears down its own megatron groups.
The ranks of a world are forked from one spawned leader that imported megatron once (as the launcher forks actors
from its zygote on a node without GPUs), instead of each rank importing it on its own. A layout that resumes from
its own checkpoint does so in a second world with a fresh leader, so the load starts in a fresh process."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.support.rendezvous import cpu_gloo_rank, rendezvous_file

# Called in every rank as `job(rank, out_dir, *args)`; a module-level function of the test, so it pickles.
RankJob = Callable[..., None]
# What a rank imports while it builds a trainer and checkpoints it, imported once in the leader before it forks.
PRELOADED = ("engines.megatron.trainer", "megatron.core.dist_checkpointing", "mbridge")


def _run_in_world(rank: int, rendezvous: str, world: int, jobs: list[tuple[RankJob, tuple]]) -> None:
    with cpu_gloo_rank(rank, rendezvous, world):
        for job, args in jobs:
            job(rank, *args)


def _lead_world(_: int, world: int, jobs: list[tuple[RankJob, tuple]]) -> None:
    """Hides the GPUs before anything can initialise CUDA (a forked child could not use it) and leaves torch one
    thread (no OpenMP pool to fork), imports what every rank needs, then forks the ranks."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(1)
    for module in PRELOADED:
        importlib.import_module(module)
    mp.start_processes(_run_in_world, args=(rendezvous_file(), world, jobs), nprocs=world, join=True,
                       start_method="fork")


def _spawn(world: int, jobs: list[tuple[RankJob, tuple]]) -> None:
    mp.spawn(_lead_world, args=(world, jobs), nprocs=1, join=True)


class WorldRuns(dict[str, Path]):
    """Layout name -> the folder its ranks wrote. Asking for a layout not run yet runs every layout of its world
    (`run(rank, out_dir, *args(name))`), then `resume` for those named in `resumed`, in fresh ranks."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory, worlds: Mapping[str, int], run: RankJob,
                 args: Callable[[str], tuple], resume: RankJob | None = None, resumed: Collection[str] = ()) -> None:
        super().__init__()
        self._tmp_path_factory = tmp_path_factory
        self._worlds = worlds
        self._run, self._resume, self._resumed = run, resume, resumed
        self._args = args

    def __missing__(self, name: str) -> Path:
        world = self._worlds[name]
        out_dirs = {other: self._tmp_path_factory.mktemp(other) for other, size in self._worlds.items()
                    if size == world}
        _spawn(world, [(self._run, (out_dir, *self._args(other))) for other, out_dir in out_dirs.items()])
        resumes = [(self._resume, (out_dir, *self._args(other))) for other, out_dir in out_dirs.items()
                   if other in self._resumed]
        if self._resume is not None and resumes:
            _spawn(world, resumes)
        self.update(out_dirs)
        return out_dirs[name]
