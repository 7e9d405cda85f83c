"""The weight-update process group exactly as an SGLang server builds it, for both ends of the transfer.

SGLang's `/init_weights_update_group` makes each server rank join a group of `world_size` members through the
`tcp://master_address:master_port` rendezvous (rank 0, the trainer, hosts the store there), with the store
wrapped in a prefix of the group name and the group created under that name. Tensors then arrive by
broadcast from rank 0. Our learner-side sender and our compatible server both call `join_weight_group`, so
the store keys, the rank layout and the backend match what a real SGLang server expects; the group is not
the process's default group (neither end needs one), and it is destroyed by name before a new one forms.

Rank layout (as SGLang computes it): rank = rank_offset + tp_rank, and engine i takes the ranks from
`1 + i * gpus_per_engine`; rank 0 is the learner.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from engines.weights.interruptible_store import GroupGivenUp, InterruptibleStore


@dataclass
class WeightGroup:
    """A joined group and the rendezvous store under it (rank 0 hosts that store; others are its clients)."""

    name: str
    rank: int
    world_size: int
    group: dist.ProcessGroup
    store: dist.Store

    def destroy(self) -> None:
        if self.group in c10d._world.pg_map:
            dist.destroy_process_group(self.group)

    @property
    def backend(self) -> str:
        return str(dist.get_backend(self.group)) if self.group in c10d._world.pg_map else "destroyed"

    def abort(self) -> None:
        """NCCL: abort the communicator (a stuck collective then ends, instead of the watchdog ending the process
        at the group timeout), then destroy the group. Destroying a gloo group waits for its pending work."""
        if self.group not in c10d._world.pg_map:
            return
        if dist.get_backend(self.group) == dist.Backend.NCCL:
            with contextlib.suppress(RuntimeError, ValueError):
                c10d._abort_process_group(self.group)
        with contextlib.suppress(RuntimeError, ValueError):
            self.destroy()


def join_weight_group(
    *,
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float,
    collective_timeout_s: float | None = None,
    given_up: Callable[[], str | None] | None = None,
) -> WeightGroup:
    """Join (rank 0: host) the group; blocks until all `world_size` members joined or `timeout_s` passed.

    `collective_timeout_s` (default `timeout_s`) is the group's own timeout for a collective. The learner sets it
    well past its own per-bucket deadline: on NCCL a collective that outlives the group timeout is torn down by
    the watchdog, which by default takes the process with it, so the learner must give up first.

    `given_up` (the host only, gloo only: a reason once the learner gave the generation up, else None) ends the
    wait for a server that died before it joined, instead of waiting out `timeout_s`: the host's store then
    does not wait for every client to connect, and gloo's rendezvous polls through `InterruptibleStore`.
    """
    if not group_name:
        raise ValueError("weight update group name must not be empty")
    if not 0 <= rank < world_size:
        raise ValueError(f"weight update group {group_name!r}: rank {rank} outside world size {world_size}")
    if group_name in c10d._world.pg_names.values():
        raise ValueError(f"weight update group {group_name!r} already exists in this process; destroy it first")
    timeout = timedelta(seconds=timeout_s)
    collective_timeout = timedelta(seconds=timeout_s if collective_timeout_s is None else collective_timeout_s)
    url = f"tcp://{_bracket_ipv6(master_address)}:{master_port}"
    interruptible = given_up is not None and rank == 0 and dist.Backend(backend) == dist.Backend.GLOO
    if interruptible:
        store = dist.TCPStore(master_address, master_port, world_size, is_master=True, timeout=timeout,
                              wait_for_workers=False, multi_tenant=True)
    else:
        store, rank, world_size = next(dist.rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group_store: dist.Store = dist.PrefixStore(group_name, store)
    if interruptible:
        assert given_up is not None
        group_store = InterruptibleStore(group_store, given_up)
    given_up_why: str | None = None
    try:
        group, _ = c10d._new_process_group_helper(
            world_size,
            rank,
            [],
            dist.Backend(backend),
            group_store,
            group_name=group_name,
            timeout=collective_timeout,
        )
    except GroupGivenUp as error:
        given_up_why = str(error)
    if given_up_why is not None:  # raised out here, with no reference left to the store: its server stops now,
        del store, group_store  # so a server still joining fails at once instead of at its own timeout
        raise GroupGivenUp(given_up_why)
    c10d._world.pg_group_ranks[group] = {member: member for member in range(world_size)}
    return WeightGroup(group_name, rank, world_size, group, store)


def broadcastable(tensor: torch.Tensor) -> torch.Tensor:
    """What a broadcast of `tensor` moves: FP8 tensors as a byte view of the same storage, since gloo has no FP8
    type. On NCCL the bytes are the same either way (torch sends FP8 as 8-bit words), so a sender that always sends
    bytes meets SGLang's receiver, which broadcasts into an FP8 tensor."""
    return tensor.view(torch.uint8) if tensor.dtype.itemsize == 1 and tensor.is_floating_point() else tensor


def _bracket_ipv6(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
