"""A request to a role's single member while the roster moves under it: the caller waits for a member within its
deadline, and never fails on the link's own bookkeeping (the evaluator crashed on an AssertionError when the
learner it was about to call was declared dead between its wake-up and the call, in the agent demo under memory
pressure)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio

from actors.runtime.peers import PeerRpc
from bus.rpc import RpcServer
from bus.schema import Ack, LeaseRenew, Member, Message


def roster_with(endpoint: str | None) -> dict[str, Member]:
    if endpoint is None:
        return {}
    return {"learner": Member(actor_id="learner", role="learner", node="n", pid=1, endpoints={"rpc": endpoint})}


@contextlib.asynccontextmanager
async def answering_server(client_id: str) -> AsyncIterator[tuple[PeerRpc, RpcServer]]:
    """A server that answers every request, and a link to the role "learner" that no roster has named yet."""
    context = zmq.asyncio.Context()

    async def answer(client: str, request: Message) -> Message:
        return Ack(ok=True, error="answered")

    server = RpcServer(context, "tcp://127.0.0.1:0")
    serving = asyncio.create_task(server.serve(answer))
    link = PeerRpc(context, client_id=client_id, role="learner", endpoint_name="rpc")
    try:
        yield link, server
    finally:
        link.close()
        server.close()
        await asyncio.wait_for(serving, 5)
        context.destroy(linger=0)


@pytest.mark.integration
async def test_a_member_that_appears_and_goes_before_the_caller_runs_is_waited_for_again() -> None:
    async with answering_server("evaluator") as (link, server):
        call = asyncio.create_task(link.call(LeaseRenew(lease_id="L"), timeout=5.0, retries=1))
        for _ in range(100):  # until the call is parked on the link's "a member is there" event
            if link._available._waiters:  # type: ignore[attr-defined]
                break
            await asyncio.sleep(0)
        assert link._available._waiters, "the call never waited for a member"  # type: ignore[attr-defined]
        link.sync(roster_with(server.endpoint))  # one appears: the waiting call is woken ...
        link.sync(roster_with(None))  # ... and it is gone before the call runs
        await asyncio.sleep(0.05)
        assert not call.done(), call  # still waiting, not failed
        link.sync(roster_with(server.endpoint))
        assert await asyncio.wait_for(call, 5) == Ack(ok=True, error="answered")

        link.sync(roster_with(None))
        with pytest.raises(TimeoutError):  # nobody there: the deadline, not the link's bookkeeping, ends the call
            await link.call(LeaseRenew(lease_id="L"), timeout=0.2, retries=1)


@pytest.mark.integration
async def test_a_call_with_short_attempts_waits_for_a_member_as_long_as_it_is_told() -> None:
    """A lease request's attempts are short (a lost frame is asked again soon), but a buffer that is restarting is
    waited for as long as before: the wait for a member is its own setting, not one attempt's timeout."""
    async with answering_server("rollout-0-0") as (link, server):
        call = asyncio.create_task(link.call(LeaseRenew(lease_id="L"), timeout=0.1, retries=1, member_wait=30.0))
        await asyncio.sleep(0.5)  # past the attempts' own timeout: still waiting for a member
        assert not call.done(), call
        link.sync(roster_with(server.endpoint))
        assert await asyncio.wait_for(call, 5) == Ack(ok=True, error="answered")
