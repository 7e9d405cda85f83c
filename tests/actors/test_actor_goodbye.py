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


class Idle(Actor):
    role = "custom"


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_a_heartbeat_that_swallowed_its_cancellation_sends_no_more_after_the_stop(tmp_path: Path) -> None:
    """A cancel that lands as a heartbeat's reply arrives can be swallowed (asyncio.wait_for, Python 3.11); the loop
    then slept an interval on and beat again, and the stop waited the 1 s it gives the heartbeat to end: one
    rollout worker's stop in six, each holding up its run's end. Here the reply comes with the cancel every time."""
    async with actor_system(tmp_path, {"num_rollout": 1}, {"controller": "controller", "custom": Idle}) as system:
        member = system["custom-0-0"]
        real_call, beating, beats_after_stop = member._controller.call, asyncio.Event(), []

        async def call_swallowing_the_cancel(message: object, **kwargs: object) -> object:
            if type(message).__name__ != "Heartbeat":
                return await real_call(message, **kwargs)
            beats_after_stop.append(member.stopping)  # an Idle member's drain is instant: none is due after it
            beating.set()
            reply = real_call(message, **kwargs)
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                return await reply  # the reply arrived with the cancellation, which is lost
            raise AssertionError("unreachable")

        member._controller.call = call_swallowing_the_cancel
        await asyncio.wait_for(beating.wait(), 10)
        member.request_stop("test: leaving on purpose")
        assert await asyncio.wait_for(asyncio.shield(system.tasks["custom-0-0"]), 30) == 0
    assert True not in beats_after_stop, "the heartbeat went on after the stop"
