"""Which CPU cores, and how many torch threads, each actor process of a CPU-only node gets (`--cpu-budget`).

On a GPU node the GPUs do the work and the OS may place the processes as it likes. On a node that trains on its
CPU, the learner and the engines compete for the same few cores, and the learner is the stage that paces a
fully-asynchronous run: measured on 2 cores with the demo's task, every actor floating over both cores gave the
learner's step as little CPU as any rollout worker's decode. So, with `--cpu-budget auto` (the default):

- fully-async (`--max-staleness` >= 1): the learner gets half the cores (at least one) to itself, with as many
  torch threads; every other actor runs on the remaining cores. The learner may still use those too (its
  second thread scores the next batch with the reference model), so no core idles while it trains.
- synchronous (`--max-staleness 0`): generation and training take turns, so nothing is pinned and the learner
  uses every core's worth of torch threads while the engines wait for its weights.

Nothing is decided on a node with GPUs, without a learner, with fewer than two usable cores, or for a learner of
several ranks (each rank would need its own cores); `--cpu-budget off` leaves every process to the OS with
`--torch-threads` threads.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CpuShare:
    """One actor's share: the cores it may run on (None: any) and its torch threads (None: --torch-threads)."""

    cores: tuple[int, ...] | None = None
    torch_threads: int | None = None


def usable_cores() -> tuple[int, ...]:
    """The cores this launcher may use (its own affinity mask, e.g. what Slurm or a container allowed)."""
    return tuple(sorted(os.sched_getaffinity(0)))


def pin_process(cores: Sequence[int]) -> None:
    """Restrict every thread of this process (an engine's decode thread, ZeroMQ's I/O threads) to `cores`;
    threads started later inherit the mask."""
    tasks = Path("/proc/self/task")
    threads = [int(tid) for tid in os.listdir(tasks)] if tasks.is_dir() else [0]
    for thread in threads:
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(thread, cores)


def plan_cpu_budget(*, cores: Sequence[int], roles: dict[str, str], gpus: int, learner_ranks: int,
                    synchronous: bool) -> dict[str, CpuShare]:
    """Each actor id's share (`roles`: actor id -> role); an actor left out gets the OS's placement."""
    learners = [actor for actor, role in roles.items() if role == "learner"]
    if gpus or not learners or len(cores) < 2 or learner_ranks != 1:
        return {}
    if synchronous:
        return {actor: CpuShare(torch_threads=len(cores)) for actor in learners}
    own = max(1, len(cores) // 2)
    shared = tuple(cores[:-own])
    plan = {actor: CpuShare(cores=shared) for actor, role in roles.items() if role != "learner"}
    plan.update({actor: CpuShare(cores=tuple(cores), torch_threads=own) for actor in learners})
    return plan


def describe_cpu_budget(plan: dict[str, CpuShare], cores: Sequence[int]) -> str:
    learner = next((share for actor, share in plan.items() if actor == "learner"), None)
    if learner is None:
        return ""
    if learner.cores is None:
        return f"cpu budget: synchronous run, the learner trains with {learner.torch_threads} threads on any core"
    others = next((share.cores for actor, share in plan.items() if actor != "learner"), None) or ()
    own = sorted(set(cores) - set(others))
    return (f"cpu budget: the learner has core(s) {','.join(map(str, own))} to itself ({learner.torch_threads} "
            f"torch threads); the other actors share core(s) {','.join(map(str, others))}")
