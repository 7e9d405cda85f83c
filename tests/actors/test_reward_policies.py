"""The reward worker of a run of several policies: each group is scored with its policy's reward and sent to its
policy's buffer; a group of no policy of the run is dropped, counted and named, and the worker goes on.

The real RewardWorker, shared as the launcher starts it (the run's whole config), on real sockets with a controller
and one recording buffer per policy; the groups are handed to its handler as its inbox would.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from structlog.testing import capture_logs

from actors.reward.actor import RewardWorker
from actors.runtime.base import Actor
from actors.runtime.context import ActorContext
from actors.runtime.handlers import handles
from bus.schema import GeneratedGroup, Sample, ScoredGroup
from tests.support.inprocess import HANG_S, ActorSystem, actor_system, write_prompts
from tests.support.policies import start_actor

GROUP_RM = "examples.slime_style.group_rm:rm"  # 1 for the label as the last number, 0.25 less for a duplicate


class ScoredRecorder(Actor):
    """Plays a policy's buffer: keeps every scored group it is sent."""

    def __init__(self, context: ActorContext) -> None:
        super().__init__(context)
        self.groups: list[ScoredGroup] = []

    @handles(ScoredGroup)
    async def on_scored(self, sender: str, group: ScoredGroup) -> None:
        self.groups.append(group)


def _group(group_id: str, policy: str | None) -> GeneratedGroup:
    samples = [Sample(sample_id=f"{group_id}/{index}", group_id=group_id, index=index, prompt="3+4=", prompt_tokens=1,
                      tokens=np.array([1, 2], dtype=np.int32), response="7", response_length=1, label="7",
                      loss_mask=np.ones(1, dtype=np.int8), status="completed") for index in range(2)]
    return GeneratedGroup(lease_id=f"lease-{group_id}", group_id=group_id, samples=samples, worker_id="rollout-0-0",
                          policy=policy)


@contextlib.asynccontextmanager
async def _run(tmp_path: Path) -> AsyncIterator[tuple[ActorSystem, ScoredRecorder, ScoredRecorder, RewardWorker]]:
    """A controller, the buffers of policies "exact" (exact_match) and "grouped" (a group reward), and the reward
    worker they share."""
    settings = {"lora_rank": 4, "prompt_data": str(write_prompts(tmp_path / "prompts.jsonl")),
                "policies": {"exact": {"rm_type": "exact_match"},
                             "grouped": {"custom_rm_path": GROUP_RM, "group_rm": True}}}
    async with actor_system(tmp_path, settings, {"controller": "controller"}) as system:
        exact = await start_actor(system, "buffer", ScoredRecorder, policy="exact")
        grouped = await start_actor(system, "buffer", ScoredRecorder, policy="grouped")
        yield system, exact, grouped, await start_actor(system, "reward", "reward", policy=None)


async def _delivered(system: ActorSystem, buffer: ScoredRecorder, count: int) -> None:
    await system.wait_for(lambda: len(buffer.groups) >= count, HANG_S, f"{count} group(s) at {buffer.actor_id}")


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_each_group_is_scored_by_its_policys_reward_and_sent_to_its_policys_buffer(tmp_path: Path) -> None:
    async with _run(tmp_path) as (system, exact, grouped, worker):

        await worker.on_generated("rollout-0-0", _group("g1", "grouped"))
        await worker.on_generated("rollout-0-0", _group("g2", "exact"))
        await _delivered(system, grouped, 1)
        await _delivered(system, exact, 1)

        assert [g.group_id for g in grouped.groups] == ["g1"] and [g.group_id for g in exact.groups] == ["g2"]
        assert [s.reward for s in grouped.groups[0].samples] == [0.75, 0.75]  # right, and each the other's duplicate
        assert [s.reward for s in exact.groups[0].samples] == [1.0, 1.0]
        assert worker.counters["samples.scored"] == 4


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_a_group_of_no_policy_of_the_run_is_dropped_by_name_and_the_worker_goes_on(tmp_path: Path) -> None:
    async with _run(tmp_path) as (system, exact, grouped, worker):

        with capture_logs() as logs:
            await worker.on_generated("rollout-0-0", _group("lost", "judge"))
            await worker.on_generated("rollout-0-0", _group("unnamed", None))
        await worker.on_generated("rollout-0-0", _group("g1", "exact"))
        await _delivered(system, exact, 1)

        assert [g.group_id for g in exact.groups] == ["g1"] and grouped.groups == []
        assert worker.counters["groups.dropped.unknown_policy"] == 2
        assert not worker.stopping and worker.run_failure is None
        errors = [r for r in logs if r["log_level"] == "error"]
        assert [(r["policy"], r["group"]) for r in errors] == [("judge", "lost"), (None, "unnamed")]
        assert all(r["policies"] == ["exact", "grouped"] for r in errors)
