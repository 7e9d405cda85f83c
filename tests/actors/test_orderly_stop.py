"""An orderly stop is not a failure: what the actors hand back or give up as a run ends is said at info, while the
same event during a run still warns. The console shows warnings, and a run that ended normally showed two."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import structlog

from bus.schema import Error, LostGroups, WeightUpdateOrder
from engines.weights.transport import WeightTransport
from tests.support.inprocess import SLEEPING, actor_system, use_spec, write_prompts
from tools.sim.pipeline import SimSpec


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_groups_a_reward_worker_held_are_warned_about_during_a_run_and_not_at_its_stop(tmp_path: Path) -> None:
    settings = {**SLEEPING, "prompt_data": str(write_prompts(tmp_path / "prompts.jsonl")), "rollout_batch_size": 2,
                "n_samples_per_prompt": 2, "use_tensorboard": False, "plots": False}
    with structlog.testing.capture_logs() as logs:
        async with actor_system(tmp_path, settings, {"controller": "controller", "buffer": "buffer"}) as system:
            buffer = system["buffer"]
            lease_id, groups = buffer.core.lease("rollout-0-0", 2)
            lost = [LostGroups(lease_ids=[lease_id], group_ids=[group.group_id], reason=reason)
                    for group, reason in zip(groups, ("reward-0-0 died (silent for 2.5 s) before scoring them",
                                                      "reward-0-0 left (controller: stop) before scoring them"),
                                             strict=True)]
            await buffer.on_lost_groups("rollout-0-0", lost[0])  # a reward worker died mid-run
            buffer.request_stop("controller: stop (trained 1 batches)")
            await buffer.on_lost_groups("rollout-0-0", lost[1])  # the reward workers stop with the run
            assert buffer.counters["groups.lost_reissued"] == 2
    reissued = [(entry["log_level"], entry["reason"]) for entry in logs if entry["event"] == "groups re-issued"]
    assert reissued == [("warning", lost[0].reason), ("info", lost[1].reason)]


class AbortedByTheLearner:
    """An engine's end of a transfer the learner gives up, as it does when it stops (`WeightPublisher.stop`)."""

    def __init__(self, engine: object, actor_id: str, log: object) -> None:
        self.actor_id = actor_id

    async def apply(self, group: dict[str, object], version: int, timeout_s: float) -> None:
        from engines.weights.base import WeightTransferError

        raise WeightTransferError(f"{self.actor_id}: transfer of version {version} aborted",
                                  {self.actor_id: "the learner is stopping (signal SIGTERM)"})

    def close(self) -> None:
        """Holds nothing."""


def _no_sender(options: object) -> object:
    raise AssertionError("no learner in this test")


ABORTED = WeightTransport(name=f"{__name__}:ABORTED", make_sender=_no_sender, make_loader=AbortedByTheLearner)


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_a_weight_update_the_learner_gave_up_is_warned_about_during_a_run_and_not_at_its_stop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_spec(SimSpec(token_seconds=1e-3, length_min=4, length_max=8), tmp_path, monkeypatch)
    settings = {**SLEEPING, "weight_transport": ABORTED.name, "use_tensorboard": False, "plots": False,
                "prompt_data": str(write_prompts(tmp_path / "prompts.jsonl"))}
    with structlog.testing.capture_logs() as logs:
        async with actor_system(tmp_path, settings, {"controller": "controller", "buffer": "buffer",
                                                     "rollout": "rollout"}) as system:
            worker = system["rollout-0-0"]
            orders = [WeightUpdateOrder(version=version, group={"transport": ABORTED.name}, timeout_s=5.0)
                      for version in (1, 2)]
            assert isinstance(await worker.on_weight_update("learner", orders[0]), Error)  # mid-run
            worker.request_stop("controller: stop (trained 1 batches)")
            assert isinstance(await worker.on_weight_update("learner", orders[1]), Error)  # the run's end
    given_up = [(entry["log_level"], entry["version"]) for entry in logs if entry["event"] == "weight update given up"]
    assert given_up == [("warning", 1), ("info", 2)]



@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_a_stopping_buffer_ends_at_once_not_after_its_next_lease_check(tmp_path: Path) -> None:
    """The buffer checks for expired leases every second; asked to stop, it used to sleep until its next check and
    make it (up to a second of every run's ordered stop, which stops the controller only after the buffer). Now
    the stop ends the wait: no lease check runs after it."""
    settings = {**SLEEPING, "prompt_data": str(write_prompts(tmp_path / "prompts.jsonl")), "lease_timeout": 20.0,
                "use_tensorboard": False, "plots": False}
    async with actor_system(tmp_path, settings, {"controller": "controller", "buffer": "buffer"}) as system:
        buffer = system["buffer"]
        check, checked_after_stop = buffer.core.expire_leases, []

        def expire_leases() -> list:
            checked_after_stop.append(buffer.stopping)
            return check()

        buffer.core.expire_leases = expire_leases
        buffer.request_stop("test: the run stops")
        assert await asyncio.wait_for(asyncio.shield(system.tasks["buffer"]), 30) == 0
    assert True not in checked_after_stop


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_a_stopping_controller_ends_at_once_not_after_its_next_liveness_check(tmp_path: Path) -> None:
    """The controller looks at its members' liveness every half heartbeat interval; asked to stop, it used to sleep
    until its next look and make it, and every launcher's end waits for the controller's (0.5 s at the default
    interval, in every run). Now the stop ends the wait: no liveness check runs after it."""
    async with actor_system(tmp_path, {"num_rollout": 1}, {"controller": "controller"}) as system:
        controller = system["controller"]
        check, checked_after_stop = controller._declare_silent_members_dead, []

        def declare_silent_members_dead(now: float) -> None:
            checked_after_stop.append(controller.stopping)
            check(now)

        controller._declare_silent_members_dead = declare_silent_members_dead
        await system.wait_for(lambda: checked_after_stop, 10, "the controller's first liveness check")
        controller.request_stop("test: the run stops")
        assert await asyncio.wait_for(asyncio.shield(system.tasks["controller"]), 30) == 0
    assert True not in checked_after_stop
