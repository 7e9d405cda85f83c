"""The controller under hostile input (issue #17): its own name cannot be registered, and what its bound sockets
drop reaches its metrics, per peer."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import zmq

from actors.runtime.base import Actor
from bus import RpcClient
from bus.schema import Error, Register
from tests.support.inprocess import actor_system


class Idle(Actor):
    """A member that only keeps its heartbeat."""

    role = "custom"


@pytest.mark.integration
async def test_a_registration_in_the_controllers_own_name_is_refused(tmp_path: Path) -> None:
    """Found by tools/hostile/campaign.py: a client registered as "controller" with role "rollout" was admitted, and
    the
    learner waited 90 s on that fake engine's weight update."""
    async with actor_system(tmp_path, {"num_rollout": 1}, {"controller": "controller", "custom": Idle}) as system:
        controller = system["controller"]
        generation = controller.generation
        claimant = RpcClient(controller.zmq, controller.context.head_address, client_id="mallory")
        try:
            claim = Register(actor_id="controller", role="rollout", node="attacker#0", pid=os.getpid() + 1,
                             endpoints={"rpc": "tcp://127.0.0.1:9"}, meta={})
            reply = await claimant.call(claim, timeout=2, retries=0)
        finally:
            claimant.close()
        assert isinstance(reply, Error) and reply.reason == "identity_in_use"
        assert "controller" not in controller.records
        assert controller.generation == generation
        assert controller.counters["refused.identity_in_use"] == 1


@pytest.mark.integration
async def test_what_the_controllers_sockets_drop_reaches_its_metrics_per_peer(tmp_path: Path) -> None:
    async with actor_system(tmp_path, {"num_rollout": 1}, {"controller": "controller", "custom": Idle}) as system:
        controller = system["controller"]
        assert controller.publisher is not None
        garbage = controller.zmq.socket(zmq.DEALER)
        garbage.setsockopt(zmq.ROUTING_ID, b"mallory")
        garbage.connect(controller.context.head_address)
        upstream = controller.zmq.socket(zmq.XSUB)
        upstream.connect(controller.publisher.endpoint)
        await asyncio.sleep(0.2)
        for _ in range(3):
            await garbage.send_multipart([b"r", b"\xc1"])
        await upstream.send(b"\x07not a subscription")
        await asyncio.sleep(0.5)
        metrics = controller.metrics()
        garbage.close(linger=0)
        upstream.close(linger=0)
        assert metrics["dropped.rpc.bad_msgpack"] == 3.0
        assert metrics["dropped_by.rpc.mallory.bad_msgpack"] == 3.0
        assert metrics["dropped_by.publish.subscriber@127.0.0.1.not_subscription"] == 1.0
        assert metrics["subscriptions.publish"] >= 1.0  # the member's own subscriptions
