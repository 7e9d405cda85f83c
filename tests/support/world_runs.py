"""Parallel layouts run in gloo ranks on CPU, one world per world size rather than one per layout, and every world
of a module forked from one leader.

Starting ranks and importing megatron in each costs more than a tiny model's step, so the parity tests run every
layout of a world in the same ranks, one after another; each trainer builds and tears down its own megatron groups.
The ranks of every world are forked from one spawned leader that imported megatron once (as the launcher forks actors
from its zygote on a node without GPUs), world after world, instead of each rank or each world importing it on its
own. A layout that resumes from its own checkpoint does so in a second set of ranks forked afterwards, so the load
starts in a fresh process, as after a learner restart. A world that fails fails only the layouts it ran."""

from __future__ import annotations

import importlib
import os
import traceback
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.support.rendezvous import cpu_gloo_rank, rendezvous_file

# Called in every rank as `job(rank, out_dir, *args)`; a module-level function of the test, so it pickles.
RankJob = Callable[..., None]
Jobs = list[tuple[RankJob, tuple]]
# What a megatron rank imports while it builds a trainer and checkpoints it, imported once in the leader before it
# forks (the default; a module whose ranks need other modules names them).
PRELOADED = ("engines.megatron.trainer", "megatron.core.dist_checkpointing", "mbridge")
# Written by the leader into each folder of a world whose ranks failed: the failure, for the tests of its layouts.
FAILURE = "world-failed.txt"


def _run_in_world(rank: int, rendezvous: str, world: int, jobs: Jobs) -> None:
    with cpu_gloo_rank(rank, rendezvous, world):
        for job, args in jobs:
            job(rank, *args)


def _lead_worlds(_: int, worlds: list[tuple[int, Jobs, Jobs, list[Path]]], preload: Sequence[str]) -> None:
    """Hides the GPUs before anything can initialise CUDA (a forked child could not use it) and leaves torch one
    thread (no OpenMP pool to fork), imports what every rank needs, then forks each world's ranks in turn: its
    layouts, then (in fresh ranks) its resumes. The leader itself never joins a world, so every fork is clean."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(1)
    for module in preload:
        importlib.import_module(module)
    for world, jobs, resumes, out_dirs in worlds:
        try:
            for stage in (jobs, resumes) if resumes else (jobs,):
                mp.start_processes(_run_in_world, args=(rendezvous_file(), world, stage), nprocs=world, join=True,
                                   start_method="fork")
        except Exception:  # the failure goes to the tests of this world's layouts
            for out_dir in out_dirs:
                (out_dir / FAILURE).write_text(traceback.format_exc())


class WorldRuns(dict[str, Path]):
    """Layout name -> the folder its ranks wrote. Asking for any layout runs every layout (`run(rank, out_dir,
    *args(name))`, grouped into one world per size), then `resume` for those named in `resumed`, in fresh ranks;
    a layout whose world failed raises that failure. `preload`: the modules the leader imports for every rank."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory, worlds: Mapping[str, int], run: RankJob,
                 args: Callable[[str], tuple], resume: RankJob | None = None, resumed: Collection[str] = (),
                 preload: Sequence[str] = PRELOADED) -> None:
        super().__init__()
        self._preload = tuple(preload)
        self._tmp_path_factory = tmp_path_factory
        self._worlds = worlds
        self._run, self._resume, self._resumed = run, resume, resumed
        self._args = args
        self._failures: dict[str, str] = {}

    def __missing__(self, name: str) -> Path:
        if name not in self._worlds:
            raise KeyError(name)
        if name not in self._failures:
            self._run_all()
        if name in self._failures:
            raise AssertionError(f"the ranks of layout {name!r}'s world failed:\n{self._failures[name]}")
        return self[name]

    def _run_all(self) -> None:
        out_dirs = {name: self._tmp_path_factory.mktemp(name) for name in self._worlds}
        worlds = []
        for size in sorted(set(self._worlds.values())):
            names = [name for name, world in self._worlds.items() if world == size]
            jobs = [(self._run, (out_dirs[name], *self._args(name))) for name in names]
            resumes = [(self._resume, (out_dirs[name], *self._args(name))) for name in names
                       if self._resume is not None and name in self._resumed]
            worlds.append((size, jobs, resumes, [out_dirs[name] for name in names]))
        mp.spawn(_lead_worlds, args=(worlds, self._preload), nprocs=1, join=True)
        for name, out_dir in out_dirs.items():
            if (out_dir / FAILURE).exists():
                self._failures[name] = (out_dir / FAILURE).read_text()
            else:
                self[name] = out_dir
