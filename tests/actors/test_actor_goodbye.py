"""An actor that stops on purpose says goodbye before anything slow at its stop can make it look dead."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import structlog

from actors.runtime.base import Actor
from tests.support.inprocess import actor_system

SLOW_TO_END_S = 4.0  # past the controller's heartbeat deadline in these tests (5 x 0.5 s)


class SlowToEnd(Actor):
    """A member with a background task that takes seconds to end once cancelled, as one waiting on a transfer
    bound to a thread does."""

    role = "custom"

    async def on_start(self) -> None:
        self.spawn(self._slow())

    async def _slow(self) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await asyncio.sleep(SLOW_TO_END_S)
            raise


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_a_member_slow_to_stop_is_recorded_as_left_not_as_dead(tmp_path: Path) -> None:
    async with actor_system(tmp_path, {"num_rollout": 1}, {"controller": "controller", "custom": SlowToEnd}) as system:
        controller, member = system["controller"], system["custom-0-0"]
        member.request_stop("test: leaving on purpose")
        assert await asyncio.wait_for(asyncio.shield(system.tasks["custom-0-0"]), 30) == 0
        record = controller.records["custom-0-0"]
        assert record.left and not record.member.alive, "the controller took a goodbye for a death"


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_a_heartbeat_that_outlives_the_goodbye_does_not_register_the_member_again(tmp_path: Path) -> None:
    """At a stop the heartbeat is cancelled before the goodbye, but asyncio.wait_for (Python 3.11) can swallow that
    cancellation: the heartbeat went on, the controller answered that it did not know the member, and the member
    warned "controller forgot us; registering again" at the end of a normal run, and joined the roster again."""
    with structlog.testing.capture_logs() as logs:
        async with actor_system(tmp_path, {"num_rollout": 1}, {"controller": "controller", "custom": Actor}) as system:
            controller, member = system["controller"], system["custom-0-0"]
            await member._leave()  # the goodbye, with the heartbeat still running
            await system.wait_for(member._heartbeat.done, 10, "the heartbeat to end once the controller forgot us")
            record = controller.records["custom-0-0"]
            assert record.left and not record.member.alive, "the member registered again after its goodbye"
    assert not [entry for entry in logs if entry.get("actor_id") == "custom-0-0" and entry["log_level"] == "warning"]
