"""The bound on what a policy adopts from other policies' episodes (`--max-adopted-waiting`).

A policy fed by another's episodes (a solver answering a proposer's questions) adopts a group of its own turns from
every such episode, whether or not its learner can keep up: a proposer group of four questions makes four solver
groups, and a solver that trains eight groups a step fell behind by hundreds. Those groups are not free: nobody can
generate them again, so past the staleness bound they are dropped, and until then they crowd the pool. So the buffer
tells the rollout workers, in every lease answer (`Lease.adoption_room`), how many more it takes; at 0 the workers
hold back the episodes that feed it (`actors.rollout.cross_policy.Crossing`), and the host policy's prompts wait
unleased, costing nothing, until this policy's learner has trained some.

A group that arrives over the bound anyway (episodes already running when the room ran out) is adopted and trained
like any other, counted (`groups.adopted_over_bound`) and logged: losing it would cost the host's work too. Once the
policy's last batch is assembled its learner trains nothing more, so the bound no longer holds the host back (it
would wait for ever), and what arrives is ignored, counted (`groups.ignored.after_last_batch`) and logged, instead
of piling up in a pool nobody drains.
"""

from __future__ import annotations

from dataclasses import dataclass

from actors.buffer.core import BufferCore
from actors.config import RunConfig
from bus.schema import ScoredGroup


@dataclass(frozen=True)
class AdoptionBound:
    """`limit`: adopted groups that may wait untrained (None: no bound); `last_batch`: the policy's num_rollout."""

    limit: int | None
    last_batch: int

    @classmethod
    def of(cls, config: RunConfig) -> AdoptionBound:
        """The default, (max_staleness + 1) batches, is what the pool can still train before it goes stale: a group
        waits behind the groups accepted before it, one batch a version, so one with more than that many ahead of it
        is past the bound by its turn and dropped (`stale_adopted`) after costing an episode; 0 lifts the bound."""
        setting = config.buffer.max_adopted_waiting
        if setting is None:
            setting = (config.buffer.max_staleness + 1) * config.rollout.rollout_batch_size
        return cls(limit=setting or None, last_batch=config.learner.num_rollout)

    def trains_no_more(self, core: BufferCore) -> bool:
        """The policy's last batch is assembled: nothing leaves the pool for training any more."""
        return max(max(core.served, default=0), core.committed_batch) >= self.last_batch

    def room(self, core: BufferCore) -> int | None:
        """How many more adopted groups the buffer takes (the lease answers' `adoption_room`); None: no bound."""
        if self.limit is None or self.trains_no_more(core):
            return None
        return max(0, self.limit - adopted_waiting(core))

    def over(self, core: BufferCore, group: ScoredGroup) -> bool:
        """`group` is adopted (about to be) while the room is spent: a race the workers' hold-back did not stop."""
        return group.host_group is not None and self.room(core) == 0


def adopted_waiting(core: BufferCore) -> int:
    """Adopted groups in the pool: scored, not yet in a batch."""
    return sum(group_id in core.adopted for group_id in core.pool)
