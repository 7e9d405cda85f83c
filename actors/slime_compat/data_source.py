"""The data source a slime rollout function receives: slime's ``get_samples``/``add_samples`` over our leases.

slime's data source hands out prompt groups from its dataset and keeps a buffer of groups put back (aborted or
partial ones), served first next time. Here the groups come from the buffer actor's leases: the worker keeps each
lease held (and renewed) while the function has its group or has put it back, so a group is never generated twice
by accident and never lost; the buffer re-issues only what is given up. Torch-free, like the rest of the rollout
worker's imports.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

from actors.slime_compat.sample import Sample, from_group
from bus.schema import Lease, PromptGroup

__all__ = ["FLAG", "GROUP_KEY", "GroupSource", "Held", "LeasedDataSource", "WorkerStopping", "group_id_of",
           "pop_first"]

GROUP_KEY = "_slipstream_group_id"  # in each handed-out sample's metadata: the PromptGroup it belongs to
FLAG = "--rollout-function-path"


def pop_first(args: Any, rollout_id: int | None, buffer: list[list[Sample]], num_samples: int) -> list[list[Sample]]:
    """slime's default buffer filter: the oldest ``num_samples`` groups, removed from ``buffer``."""
    taken = buffer[:num_samples]
    del buffer[: len(taken)]
    return taken


def group_id_of(sample: Any) -> str | None:
    """The id of the PromptGroup a handed-out sample belongs to (None for a sample we never handed out)."""
    metadata = getattr(sample, "metadata", None)
    return metadata.get(GROUP_KEY) if isinstance(metadata, dict) else None


@dataclass
class Held:
    """A training group this worker holds a lease on while the rollout function has it (or has put it back)."""

    group: PromptGroup
    lease_id: str
    version: int  # engine version when the group was first handed out: the oldest weights its tokens can be from


class WorkerStopping(RuntimeError):
    """The rollout worker is stopping: a data source call gets no more groups."""


class GroupSource(Protocol):
    """What the data source needs of a rollout worker (`RolloutWorker` is one), all used on the worker's loop."""

    @property
    def stopping(self) -> bool: ...

    async def request_lease(self, max_groups: int) -> Lease | None:
        """Up to `max_groups` groups from the buffer, or None when it did not answer."""

    def hold(self, lease: Lease) -> None:
        """Count the lease's groups in flight and keep renewing it until each group is released."""

    def generate_group(self, lease: Lease, group: PromptGroup) -> None:
        """Generate, score and send one group the worker's own way (for evaluation groups)."""

    async def release(self, lease_id: str, group: PromptGroup) -> None:
        """`group` of `lease_id` is done with."""


class LeasedDataSource:
    """slime's data source over the buffer's leases. The slime methods are called from the function's thread; each
    runs as a coroutine on the worker's loop (``loop``), where the groups are leased and tracked."""

    def __init__(self, groups: GroupSource, loop: asyncio.AbstractEventLoop, *, args: Any, path: str,
                 lease_timeout: float) -> None:
        self.groups = groups
        self.loop = loop
        self.args = args
        self.path = path
        self.lease_timeout = lease_timeout
        self.pending: list[list[Sample]] = []  # groups put back with add_samples (slime's data buffer)
        self.held: dict[str, Held] = {}  # group id -> every group handed out or put back, not yet returned
        self.rollout_id = 0  # of the call in progress, set by the runner
        self.version = 0  # engine version when that call began

    # ------------------------------------------------------------------------ slime's interface (function thread)
    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        """``num_samples`` groups of ``n_samples_per_prompt`` samples: put-back groups first, then new leases."""
        return self._on_loop(self.take(num_samples), timeout=self.lease_timeout + 30.0)

    def add_samples(self, samples: list[list[Sample]]) -> None:
        """Put groups back (unfinished ones, over-sampled ones): the next ``get_samples`` returns them first."""
        self._on_loop(self.put_back(samples), timeout=30.0)

    def save(self, rollout_id: int) -> None:
        """Nothing to save: the buffer's durable log keeps the dataset position (put-back groups are re-issued)."""

    def load(self, rollout_id: int | None = None) -> None:
        """Nothing to load (see ``save``)."""

    def get_buffer_length(self) -> int:
        return len(self.pending)

    def __len__(self) -> int:
        """The put-back groups; the dataset itself lives in the buffer, which never runs dry (it loops epochs)."""
        return len(self.pending)

    def _on_loop(self, coroutine: Coroutine[Any, Any, Any], *, timeout: float) -> Any:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            coroutine.close()
            raise RuntimeError(f"{FLAG} {self.path}: data_source called on the rollout worker's own event loop, "
                               "where it would wait on itself; call it from the rollout function's thread")
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        # Waited on apart from its result: the call's own TimeoutError (a lease shortfall) is the same class.
        if not concurrent.futures.wait([future], timeout).done:
            future.cancel()
            raise TimeoutError(f"{FLAG} {self.path}: the rollout worker did not answer a data_source call within "
                               f"{timeout:g}s")
        return future.result()

    # ------------------------------------------------------------------------------- on the worker's loop
    async def take(self, num_samples: int) -> list[list[Sample]]:
        if not isinstance(num_samples, int) or num_samples < 0:
            raise ValueError(f"{FLAG} {self.path}: data_source.get_samples({num_samples!r}) needs a count >= 0")
        taken = pop_first(self.args, None, self.pending, num_samples)  # put-back groups first, oldest first
        fresh = await self._lease(num_samples - len(taken)) if num_samples > len(taken) else []
        return taken + [self._samples(held) for held in fresh]

    async def put_back(self, samples: list[list[Sample]]) -> None:
        if not samples:
            return
        if not isinstance(samples, list) or not all(isinstance(group, list) for group in samples):
            raise TypeError(f"{FLAG} {self.path}: data_source.add_samples takes a list of groups (lists of Sample), "
                            f"got {type(samples).__name__}")
        waiting = {group_id_of(group[0]) for group in self.pending if group}
        for group in samples:
            ids = {group_id_of(sample) for sample in group}
            group_id = next(iter(ids)) if len(ids) == 1 else None
            if group_id is None or group_id not in self.held:
                raise ValueError(f"{FLAG} {self.path}: data_source.add_samples got a group that is not one group "
                                 f"handed out by get_samples and still held (group ids {sorted(map(str, ids))})")
            if group_id in waiting:
                raise ValueError(f"{FLAG} {self.path}: group {group_id} was put back twice")
            expected = self.held[group_id].group.n_samples
            if len(group) != expected:
                raise ValueError(f"{FLAG} {self.path}: put-back group {group_id} has {len(group)} samples; "
                                 f"n_samples_per_prompt is {expected}")
            waiting.add(group_id)
        self.pending.extend(samples)

    def settle(self, group_id: str) -> Held:
        """The returned group `group_id`, no longer held or pending."""
        self.pending = [group for group in self.pending if group_id_of(group[0]) != group_id]
        return self.held.pop(group_id)

    def abandoned(self) -> list[Held]:
        """After a call: the groups the function took and neither returned nor put back, no longer held."""
        waiting = {group_id_of(group[0]) for group in self.pending}
        return [self.held.pop(group_id) for group_id in [g for g in self.held if g not in waiting]]

    async def _lease(self, wanted: int) -> list[Held]:
        deadline = time.monotonic() + self.lease_timeout
        got: list[Held] = []
        while len(got) < wanted:
            if self.groups.stopping:
                raise WorkerStopping(f"{FLAG} {self.path}: the rollout worker is stopping")
            lease = await self.groups.request_lease(wanted - len(got))
            fresh = self._hold(lease) if lease is not None and lease.groups else []
            got += fresh
            if len(got) >= wanted:
                break
            if time.monotonic() >= deadline:
                self.pending.extend(self._samples(held) for held in got)  # still leased: the next call gets them
                raise TimeoutError(
                    f"{FLAG} {self.path}: data_source.get_samples asked the buffer for {wanted} groups and obtained "
                    f"{len(got)} within --lease-timeout {self.lease_timeout:g}s (those are kept for the next call). "
                    "The buffer admits at most (batches trained + --max-staleness + 1) x --rollout-batch-size groups, "
                    "so a function that takes more groups than it returns waits on the learner: raise "
                    "--max-staleness, or take fewer")
            await asyncio.sleep(0.05 if fresh else 0.2)
        return got

    def _hold(self, lease: Lease) -> list[Held]:
        """Keep a new lease; another role's groups (the evaluator's) go the worker's own way, its training groups
        to the function."""
        self.groups.hold(lease)
        fresh = []
        for group in lease.groups:
            if group.owner is not None:
                self.groups.generate_group(lease, group)
                continue
            held = self.held[group.group_id] = Held(group=group, lease_id=lease.lease_id, version=self.version)
            fresh.append(held)
        return fresh

    def _samples(self, held: Held) -> list[Sample]:
        samples = [from_group(held.group, index) for index in range(held.group.n_samples)]
        for sample in samples:
            sample.metadata[GROUP_KEY] = held.group.group_id
            sample.rollout_id = self.rollout_id
        return samples
