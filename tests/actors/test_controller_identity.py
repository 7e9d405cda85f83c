"""The controller binds an actor's name to the connection it registered from (issue #16, defect 1).

A client that claims a live actor's name (a heartbeat, a leave, a second registration, a version announcement)
is refused and counted; the real actor stays in the roster, alive, and nobody hears of a death or a return.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from actors.runtime.base import Actor
from bus import RpcClient, RpcTimeout
from bus.schema import Ack, Control, Error, Heartbeat, Leave, Register, VersionAnnouncement
from tests.support.inprocess import actor_system


class Idle(Actor):
    """A member that only keeps its heartbeat."""

    role = "custom"


@pytest.mark.integration
async def test_claims_on_a_live_actors_name_are_refused(tmp_path: Path) -> None:
    async with actor_system(tmp_path, {"num_rollout": 1}, {"controller": "controller", "custom": Idle}) as system:
        controller = system["controller"]
        record = controller.records["custom-0-0"]
        generation = controller.generation
        spoofer = RpcClient(controller.zmq, controller.context.head_address, client_id="custom-0-0")
        try:
            beat = await spoofer.call(Heartbeat(actor_id="custom-0-0", seq=1), timeout=2, retries=0)
            assert isinstance(beat, Error) and beat.reason == "not_owner"
            claim = Register(actor_id="custom-0-0", role="custom", node="elsewhere#0", pid=os.getpid() + 1,
                             endpoints={"rpc": "tcp://127.0.0.1:9"}, meta={})
            registered = await spoofer.call(claim, timeout=2, retries=0)
            assert isinstance(registered, Error) and registered.reason == "identity_in_use"
            left = await spoofer.call(Leave(actor_id="custom-0-0", reason="spoofed"), timeout=2, retries=0)
            assert left == Ack(ok=False, error="custom-0-0 is registered from another connection")
            announced = await spoofer.call(VersionAnnouncement(version=99, weights_version=99), timeout=2,
                                           retries=0)
            assert isinstance(announced, Ack) and not announced.ok
        finally:
            spoofer.close()
        seen = record.last_seen
        await asyncio.sleep(1.2)  # two heartbeats of the real actor
        current = controller.records["custom-0-0"]
        assert current.member.alive and current.member.endpoints == record.member.endpoints
        assert current.last_seen > seen, "the real actor's heartbeats are no longer accepted"
        assert controller.generation == generation, "a spoofed claim changed the roster"
        assert controller.latest_version is None
        assert controller.counters["refused.not_owner"] == 2
        assert controller.counters["refused.identity_in_use"] == 1


@pytest.mark.integration
async def test_a_restarted_process_takes_its_name_back_once_the_old_one_is_gone(tmp_path: Path) -> None:
    async with actor_system(tmp_path, {"num_rollout": 1}, {"controller": "controller", "custom": Idle}) as system:
        controller = system["controller"]
        old = system["custom-0-0"]
        old_endpoints = old.endpoints()
        old._controller.close()  # the process is gone: its connection detaches
        system.tasks["custom-0-0"].cancel()
        await asyncio.sleep(0.2)
        successor = RpcClient(controller.zmq, controller.context.head_address, client_id="custom-0-0")
        try:
            claim = Register(actor_id="custom-0-0", role="custom", node="here#0", pid=os.getpid() + 1,
                             endpoints={"rpc": "tcp://127.0.0.1:9"}, meta={})
            reply = await successor.call(claim, timeout=2, retries=0)
        finally:
            successor.close()
        assert not isinstance(reply, Error), reply
        assert reply.incarnation == 1 and controller.records["custom-0-0"].member.endpoints != old_endpoints


@pytest.mark.integration
async def test_a_run_that_is_ending_turns_late_joiners_away_and_stops_members_that_missed_the_stop(
    tmp_path: Path,
) -> None:
    """A worker node that starts after the run finished registered with a controller about to exit, never heard
    the stop it had broadcast, and retried a gone head for minutes (tests/system/test_cluster_launch.py)."""
    async with actor_system(tmp_path, {"num_rollout": 1}, {"controller": "controller", "custom": Idle}) as system:
        controller, member = system["controller"], system["custom-0-0"]
        controller._stop_reason = "stop requested by learner: trained 1 batches"
        controller._set_state("draining")  # as a "stop" control does, before the controller exits
        late = RpcClient(controller.zmq, controller.context.head_address, client_id="custom-1-0")
        try:
            claim = Register(actor_id="custom-1-0", role="custom", node="node1#0", pid=os.getpid() + 7,
                             endpoints={"rpc": "tcp://127.0.0.1:9"}, meta={})
            reply = await late.call(claim, timeout=2, retries=0)
        finally:
            late.close()
        assert isinstance(reply, Error) and reply.reason == "run_over", reply
        assert "trained 1 batches" in reply.detail and "custom-1-0" not in controller.records
        # a member that missed the broadcast hears it in the answer to its next heartbeat once the run stopped
        controller._set_state("stopped")
        await system.wait_for(lambda: member.stopping, 5, "the member to stop")
        assert member._stop_reason.startswith("controller: the run is stopped")


@pytest.mark.integration
async def test_a_stopping_controller_answers_until_a_member_that_missed_the_stop_heard_it(tmp_path: Path) -> None:
    """The controller broadcast the stop and closed 0.2 s later: a member whose copy of the broadcast was lost
    then heartbeated a gone head, and its node took the finished run for a lost head."""
    async with actor_system(tmp_path, {"num_rollout": 1}, {"controller": "controller", "custom": Idle}) as system:
        controller, member = system["controller"], system["custom-0-0"]
        missed: list[str] = []

        async def lost_in_transit(control: Control) -> None:
            missed.append(control.command)

        member._apply_control = lost_in_transit  # type: ignore[method-assign]  # the broadcast is dropped
        controller._stop_reason = "stop requested by learner: trained 1 batches"
        controller.request_stop("trained 1 batches")
        await system.wait_for(lambda: member.stopping, 5, "the member to hear the run is over")
        assert missed == ["stop"]
        assert member._stop_reason.startswith("controller: the run is stopped")
        assert controller.records["custom-0-0"].told_over


@pytest.mark.integration
async def test_a_stopping_controller_tells_again_a_member_whose_run_over_answer_was_lost(tmp_path: Path) -> None:
    """A fresh-clone CI run: the heartbeat answered "run over" reached the member after its call had timed out, so
    the controller counted the member as told and closed while the member, which never heard, heartbeated a gone
    head. A member that heartbeats again after it was told did not hear it."""
    async with actor_system(tmp_path, {"num_rollout": 1}, {"controller": "controller", "custom": Idle}) as system:
        controller, member = system["controller"], system["custom-0-0"]
        lost: list[str] = []

        async def broadcast_lost_in_transit(control: Control) -> None:
            lost.append(control.command)

        real_call = member._controller.call

        async def answer_lost_once(request: object, **kwargs: object) -> object:
            reply = await real_call(request, **kwargs)
            if isinstance(reply, Error) and reply.reason == "run_over" and "answer" not in lost:
                lost.append("answer")  # the controller sent it; the member had given up waiting
                raise RpcTimeout(controller.context.head_address, type(request).__name__, 1, 0.5)
            return reply

        member._apply_control = broadcast_lost_in_transit  # type: ignore[method-assign]
        member._controller.call = answer_lost_once  # type: ignore[method-assign]
        controller.request_stop("trained 1 batches")
        await system.wait_for(lambda: member.stopping, 5, "the member to hear the run is over")
        assert lost == ["stop", "answer"]
        assert member._stop_reason.startswith("controller: the run is stopped")
