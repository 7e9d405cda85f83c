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

Several learners (one per policy of a run of several, actors.config.policies) split the learner's half: each
gets its own consecutive slice of it (and the shared cores), with a torch thread per core of its slice; with fewer
such cores than learners (2 cores, 2 policies) they all take turns on them with one thread each. A synchronous run
gives each learner an equal part of the cores' worth of threads: the policies' steps may run at the same time.

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
        threads = max(1, len(cores) // len(learners))
        return {actor: CpuShare(torch_threads=threads) for actor in learners}
    own = max(1, len(cores) // 2)
    shared, reserved = tuple(cores[:-own]), tuple(cores[-own:])
    plan = {actor: CpuShare(cores=shared) for actor, role in roles.items() if role != "learner"}
    for actor, slice_ in zip(learners, _split(reserved, len(learners)), strict=True):
        plan[actor] = CpuShare(cores=tuple(sorted({*shared, *slice_})), torch_threads=len(slice_))
    return plan


def _split(reserved: tuple[int, ...], learners: int) -> list[tuple[int, ...]]:
    """The learners' cores in consecutive slices, one per learner (the first ones one core more where they do not
    divide); where there are fewer cores than learners, every learner takes turns on all of them."""
    if len(reserved) < learners:
        return [reserved] * learners
    size, extra = divmod(len(reserved), learners)
    bounds = [index * size + min(index, extra) for index in range(learners + 1)]
    return [reserved[bounds[index]:bounds[index + 1]] for index in range(learners)]


def describe_cpu_budget(plan: dict[str, CpuShare], cores: Sequence[int], roles: dict[str, str]) -> str:
    learners = {actor: share for actor, share in plan.items() if roles.get(actor) == "learner"}
    if not learners:
        return ""
    one = len(learners) == 1
    threads = next(iter(learners.values())).torch_threads
    if all(share.cores is None for share in learners.values()):
        who = "the learner trains" if one else f"each of its {len(learners)} learners trains"
        return f"cpu budget: synchronous run, {who} with {threads} threads on any core"
    others = next((share.cores for actor, share in plan.items() if actor not in learners), None) or ()

    def own(share: CpuShare) -> str:
        return ",".join(map(str, sorted(set(share.cores or ()) - set(others))))

    if one:
        learner = next(iter(learners.values()))
        text = f"the learner has core(s) {own(learner)} to itself ({learner.torch_threads} torch threads)"
    else:
        text = "; ".join(f"{actor} trains on core(s) {own(share)} ({share.torch_threads} torch threads)"
                         for actor, share in learners.items())
    return f"cpu budget: {text}; the other actors share core(s) {','.join(map(str, others))}"
