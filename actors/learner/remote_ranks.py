"""The learner's ranks on a node other than the head, kept running by an actor of that node's launcher.

A learner on N nodes (`--actor-num-nodes N`) is one world of G ranks per node. Rank 0, the learner actor on the
head, starts the head's ranks itself (`ranks.py`); it cannot start processes on other nodes, so on node n this
actor starts ranks nG..nG+G-1. They wait at rank 0's store (`learner_world_address`, fixed for the run) for the
world to form, and leave it when rank 0 goes (a restart, or the end of the run). Whenever one of them exits, or
rank 0's world is gone while they are still in it (a rank stopped or hung cannot leave by itself), this actor
ends the set and starts a fresh one, which waits for rank 0's next incarnation: either side's failure becomes
one learner restart, resumed from its checkpoint, as on one node.

Being an actor, it registers with the controller (the roster shows the node's learner ranks), stops with the
run, and is restarted by its launcher if it crashes.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from datetime import timedelta

import torch.distributed as dist

from actors.config.run import learner_ranks_per_node
from actors.learner.ranks import WORLD_KEY, start_follower, store_client, world_address, write_rank_config
from actors.runtime.base import Actor
from actors.runtime.restarts import RestartPolicy

POLL_S = 0.5
WORLD_POLL_S = 2.0  # how often rank 0's store is asked which world is up
STORE_TIMEOUT = timedelta(seconds=2)
QUICK_EXIT_S = 60.0  # a set that lasted less than this waits longer before the next (RestartPolicy's doubling)
END_GRACE_S = 10.0  # SIGTERM, then SIGKILL after this long


class RemoteLearnerRanks(Actor):
    """Node n's learner ranks, started for rank 0's world and started again whenever one of them exits."""

    async def on_start(self) -> None:
        config = self.settings.run
        node, nodes = self.context.node_rank, config.placement.actor_num_nodes
        if not 0 < node < nodes:
            raise ValueError(f"learner ranks on node {node}: the learner spans nodes 0..{nodes - 1} "
                             f"(--actor-num-nodes {nodes}), and the head (node 0) starts its own ranks")
        host, port = world_address(config)
        self.init_method = f"tcp://{host}:{port}"
        per_node = learner_ranks_per_node(config)
        self.ranks = range(node * per_node, (node + 1) * per_node)
        config_file = self.context.run_dir / "actors" / f"learner-ranks-node{node}.json"
        self.config_path = write_rank_config(config, config_file)
        self.followers: dict[int, subprocess.Popen[bytes]] = {}
        self.set_world: str | None = None  # the world of rank 0 the running set is in, once one is seen up

    async def run(self) -> None:
        ends_in_a_row = 0  # sets ended since one that lasted QUICK_EXIT_S
        while not self.stopping:
            started = time.monotonic()
            self._start_set()
            ended = await self._set_ended()
            if ended is None:
                return
            await asyncio.to_thread(self._end_set)
            lasted = time.monotonic() - started
            ends_in_a_row = 1 if lasted > QUICK_EXIT_S else ends_in_a_row + 1
            delay = RestartPolicy(backoff_initial_s=self.settings.restart_backoff).backoff(ends_in_a_row)
            self.log.warning(f"{ended}; starting a fresh set for rank 0's next world", lasted_s=round(lasted, 1),
                             next_in_s=delay)
            await asyncio.sleep(delay)

    async def on_stop(self) -> None:
        await asyncio.to_thread(self._end_set)

    def _start_set(self) -> None:
        world = self.settings.run.trainer.learner_ranks
        first = self.ranks[0]
        self.followers = {rank: start_follower(rank, rank - first, world, self.init_method, self.config_path,
                                               self.context.run_dir)
                          for rank in self.ranks}
        self.log.info("learner ranks started", ranks=f"{first}-{self.ranks[-1]}", world=world,
                      rank_zero=self.init_method, pids=[process.pid for process in self.followers.values()])

    async def _set_ended(self) -> str | None:
        """Why the running set is over (a rank exited; rank 0's world it is in is gone); None once this actor
        stops."""
        self.set_world, next_look = None, 0.0
        while not self.stopping:
            for rank, process in self.followers.items():
                code = process.poll()
                if code is not None:
                    return f"learner rank {rank} of this node exited with code {code}"
            if time.monotonic() >= next_look:
                world = await asyncio.to_thread(self._world_up)
                if self.set_world is None:
                    self.set_world = world  # the set is in (or joining) the world that is up now
                elif world != self.set_world:
                    return f"rank 0's world {self.set_world} is gone ({'now ' + world if world else 'no answer'})"
                next_look = time.monotonic() + WORLD_POLL_S
            await asyncio.sleep(POLL_S)
        return None

    def _world_up(self) -> str | None:
        """The token of rank 0's world now up, or None when its store does not answer (rank 0 is restarting)."""
        try:
            return store_client(self.init_method, STORE_TIMEOUT).get(WORLD_KEY).decode()
        except (RuntimeError, dist.DistError):
            return None

    def _end_set(self) -> None:
        for process in self.followers.values():
            if process.poll() is None:
                process.terminate()
                process.send_signal(signal.SIGCONT)  # a stopped rank gets its SIGTERM now, not when killed
        deadline = time.monotonic() + END_GRACE_S
        for process in self.followers.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.followers = {}

