"""Which GPUs each actor process of a node owns, decided once by that node's launcher.

Every process is handed its devices explicitly, the way a scheduler would: the launcher computes this node's
placement, writes each actor's share into its context as a `CUDA_VISIBLE_DEVICES` string, and the actor process
sets that variable before anything touches CUDA. Inside a process, devices are therefore always numbered from 0:
learner rank r uses `cuda:r`, a rollout worker's engine uses `cuda:0`, and an SGLang server it launches gets
`--base-gpu-id 0` with the worker's GPUs as its tensor-parallel ranks. The indices used here are positions in
the launcher's own `CUDA_VISIBLE_DEVICES` (a Slurm allocation of GPUs 4-7 stays GPUs 4-7).

Layout on a node, as slime lays out its placement groups when not colocated: the learner ranks take the first
GPUs, then each rollout worker takes `--rollout-num-gpus-per-engine` consecutive GPUs. A node with too few GPUs
for that is an error that gives the numbers, with one exception for the smallest machines: with the torch
rollout engine, rollout workers on the head may all share learner rank 0's GPU. Their weights then move over
CUDA IPC (`engines/weights/cuda_ipc.py`), because NCCL refuses two ranks on one device.

`--colocate` asks for that sharing whatever the GPU count (slime's colocated mode): the engines live on the
learner's GPU and take turns with it. On a node without GPUs the engines' weights then move through
shared-memory files (`engines/weights/shared_memory.py`) instead of a gloo broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass

from actors.config.engines import engine_spec, engines_that


class PlacementError(ValueError):
    """This node cannot host the actors it was asked to run; the message gives the counts."""


@dataclass(frozen=True)
class NodePlacement:
    """GPU indices (positions in the launcher's visible devices) of this node's learner ranks and rollout workers.

    Empty tuples everywhere on a machine without GPUs.
    """

    gpus: int
    learner: tuple[int, ...]
    rollout: tuple[tuple[int, ...], ...]
    shared: bool = False  # rollout workers share learner rank 0's GPU

    def describe(self) -> str:
        if not self.gpus:
            return "no GPU on this node: every actor runs on the CPU"
        parts = []
        if self.learner:
            parts.append(f"learner ranks on GPU {_span(self.learner)}")
        for index, devices in enumerate(self.rollout):
            parts.append(f"rollout worker {index} on GPU {_span(devices)}" if devices
                         else f"rollout worker {index} on no GPU (its engine needs none)")
        text = "; ".join(parts) or "no GPU actor on this node"
        if self.shared:
            text += " (rollout workers share the learner's GPU: weights move over CUDA IPC)"
        return text


def place_node(
    *,
    gpus: int,
    learner_ranks: int,
    rollout_workers: int,
    gpus_per_engine: int,
    rollout_engine: str,
    rollout_needs_gpu: bool = True,
    colocate: bool = False,
) -> NodePlacement:
    """Lay this node's GPU actors out; `learner_ranks` is 0 on a node that runs no learner.

    `rollout_needs_gpu` is False for an engine plugin that declares it runs without one (a remote API, the
    pipeline benchmark's sleeping engine): its workers get no GPU and take none from the learner.
    """
    if gpus < 0 or learner_ranks < 0 or rollout_workers < 0 or gpus_per_engine < 1:
        raise PlacementError(
            f"placement needs non-negative counts and gpus_per_engine >= 1, got gpus={gpus}, "
            f"learner_ranks={learner_ranks}, rollout_workers={rollout_workers}, gpus_per_engine={gpus_per_engine}"
        )
    if gpus == 0:
        return NodePlacement(0, (), tuple(() for _ in range(rollout_workers)))
    if colocate and learner_ranks and rollout_needs_gpu:
        return _colocated(gpus, learner_ranks, rollout_workers, gpus_per_engine)
    if not rollout_needs_gpu:
        placed = place_node(gpus=gpus, learner_ranks=learner_ranks, rollout_workers=0, gpus_per_engine=1,
                            rollout_engine=rollout_engine)
        return NodePlacement(gpus, placed.learner, tuple(() for _ in range(rollout_workers)))
    if learner_ranks > gpus:
        raise PlacementError(
            f"the learner needs {learner_ranks} GPUs (one per rank) but this node has {gpus}; "
            "lower --learner-ranks / --actor-num-gpus-per-node"
        )
    learner = tuple(range(learner_ranks))
    needed = learner_ranks + rollout_workers * gpus_per_engine
    if needed <= gpus:
        rollout = tuple(
            tuple(range(learner_ranks + i * gpus_per_engine, learner_ranks + (i + 1) * gpus_per_engine))
            for i in range(rollout_workers)
        )
        return NodePlacement(gpus, learner, rollout)
    spec = engine_spec(rollout_engine)
    if learner_ranks and spec is not None and spec.shares_learner_gpu and gpus_per_engine == 1:
        return NodePlacement(gpus, learner, tuple((0,) for _ in range(rollout_workers)), shared=True)
    sharers = " or ".join(f"--rollout-engine {name}" for name in engines_that("shares_learner_gpu"))
    raise PlacementError(
        f"this node has {gpus} GPUs but its actors need {needed}: {learner_ranks} for the learner and "
        f"{rollout_workers} rollout workers x {gpus_per_engine} GPUs per engine"
        + (f"; {spec.noun} needs GPUs of its own (use {sharers} to share the learner's GPU)"
           if spec is not None and not spec.shares_learner_gpu else "")
    )


def _colocated(gpus: int, learner_ranks: int, rollout_workers: int, gpus_per_engine: int) -> NodePlacement:
    """Every rollout worker on learner rank 0's GPU: the engine that shares it (the torch engine, or an SGLang
    server) opens the learner's tensors over CUDA IPC, which needs the learner's own device."""
    if gpus_per_engine != 1:
        raise PlacementError(f"colocate: --rollout-num-gpus-per-engine {gpus_per_engine}; a colocated engine shares "
                             "the learner's one GPU (--rollout-num-gpus-per-engine 1)")
    if learner_ranks != 1:
        raise PlacementError(f"colocate: {learner_ranks} learner ranks; colocated mode runs one learner rank on a "
                             "GPU node for now (the engines receive over CUDA IPC from rank 0's device)")
    return NodePlacement(gpus, (0,), tuple((0,) for _ in range(rollout_workers)), shared=True)


def visible_devices(indices: tuple[int, ...], parent: str | None) -> str:
    """The `CUDA_VISIBLE_DEVICES` value for a process owning `indices`, relative to the launcher's own value."""
    if parent is None or not parent.strip():
        return ",".join(str(index) for index in indices)
    listed = [item.strip() for item in parent.split(",") if item.strip()]
    for index in indices:
        if index >= len(listed):
            raise PlacementError(
                f"GPU {index} asked for, but CUDA_VISIBLE_DEVICES={parent!r} lists only {len(listed)} devices"
            )
    return ",".join(listed[index] for index in indices)


def _span(devices: tuple[int, ...]) -> str:
    if len(devices) > 1 and devices == tuple(range(devices[0], devices[-1] + 1)):
        return f"{devices[0]}-{devices[-1]}"
    return ",".join(str(d) for d in devices)
