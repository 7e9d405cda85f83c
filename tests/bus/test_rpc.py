"""RPC channel over real sockets: replies, errors, retries answered once, timeouts, garbage."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import msgpack
import pytest
import zmq
import zmq.asyncio

from bus.codec import decode
from bus.rpc import RpcClient, RpcClosed, RpcServer, RpcTimeout
from bus.schema import Ack, Error, Heartbeat, LeaseRenew, Message
from bus.sockets import peer_name


class Echo:
    """A handler that records calls, can be slowed down, and fails on request."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.calls: list[tuple[str, Message]] = []

    async def __call__(self, client: str, request: Message) -> Message | None:
        self.calls.append((client, request))
        await asyncio.sleep(self.delay)
        if isinstance(request, LeaseRenew) and request.lease_id == "boom":
            raise RuntimeError("lease store unavailable")
        if isinstance(request, Heartbeat):
            return None
        return Ack(ok=True, error=f"{peer_name(client)}:{getattr(request, 'lease_id', '')}")


@pytest.fixture
async def served(zctx: zmq.asyncio.Context) -> AsyncIterator[tuple[RpcServer, Echo]]:
    server, handler = RpcServer(zctx, "tcp://127.0.0.1:0"), Echo()
    task = asyncio.create_task(server.serve(handler))
    yield server, handler
    server.close()
    await asyncio.wait_for(task, 5)  # serve() returns once the server is closed


@pytest.mark.integration
async def test_call_returns_the_handlers_reply(zctx: zmq.asyncio.Context, served: tuple[RpcServer, Echo]) -> None:
    server, handler = served
    client = RpcClient(zctx, server.endpoint, client_id="rollout-1")
    reply = await client.call(LeaseRenew(lease_id="L1"))
    assert reply == Ack(ok=True, error="rollout-1:L1")
    [(sender, request)] = handler.calls
    assert (peer_name(sender), request) == ("rollout-1", LeaseRenew(lease_id="L1"))
    assert sender.startswith("rollout-1#"), "the handler sees the connection: the name and a per-client nonce"
    client.close()


@pytest.mark.integration
async def test_handler_returning_nothing_replies_ack(
    zctx: zmq.asyncio.Context, served: tuple[RpcServer, Echo]
) -> None:
    client = RpcClient(zctx, served[0].endpoint, client_id="c")
    assert await client.call(Heartbeat(actor_id="c", seq=1)) == Ack(ok=True, error=None)
    client.close()


@pytest.mark.integration
async def test_handler_exception_becomes_an_error_reply(
    zctx: zmq.asyncio.Context, served: tuple[RpcServer, Echo]
) -> None:
    client = RpcClient(zctx, served[0].endpoint, client_id="c")
    reply = await client.call(LeaseRenew(lease_id="boom"))
    assert reply == Error(reason="handler_error", detail="RuntimeError: lease store unavailable")
    assert await client.call(LeaseRenew(lease_id="fine")) == Ack(ok=True, error="c:fine")  # still serving
    client.close()


@pytest.mark.integration
async def test_retries_of_a_slow_call_run_the_handler_once(zctx: zmq.asyncio.Context) -> None:
    server, handler = RpcServer(zctx, "tcp://127.0.0.1:0"), Echo(delay=0.35)
    serving = asyncio.create_task(server.serve(handler))
    client = RpcClient(zctx, server.endpoint, client_id="learner")
    reply = await client.call(LeaseRenew(lease_id="B7"), timeout=0.1, retries=6)
    assert reply == Ack(ok=True, error="learner:B7")
    assert len(handler.calls) == 1, "a retried request ran the handler again"
    assert client.retries >= 2 and server.duplicates >= 2
    client.close()
    server.close()
    await serving


@pytest.mark.integration
async def test_a_retry_after_the_reply_was_lost_is_answered_from_the_cache(
    zctx: zmq.asyncio.Context, served: tuple[RpcServer, Echo]
) -> None:
    server, handler = served
    raw = zctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.ROUTING_ID, b"raw-client")
    raw.connect(server.endpoint)
    request = msgpack.packb({"type": "LeaseRenew", "v": 1, "lease_id": "L9"})
    replies = []
    for _ in range(3):  # the same request id again after each reply, as if every reply had been lost
        await raw.send_multipart([b"req-1", request])
        replies.append(await asyncio.wait_for(raw.recv_multipart(), 5))
    assert all(request_id == b"req-1" for request_id, _ in replies)
    assert [decode(reply) for _, reply in replies] == [Ack(ok=True, error="raw-client:L9")] * 3
    assert len(handler.calls) == 1
    raw.close(linger=0)


@pytest.mark.integration
async def test_concurrent_calls_get_their_own_replies(
    zctx: zmq.asyncio.Context, served: tuple[RpcServer, Echo]
) -> None:
    client = RpcClient(zctx, served[0].endpoint, client_id="c")
    replies = await asyncio.gather(*(client.call(LeaseRenew(lease_id=f"L{i}")) for i in range(20)))
    assert [reply.error for reply in replies] == [f"c:L{i}" for i in range(20)]
    client.close()


@pytest.mark.integration
async def test_call_to_nobody_times_out_naming_endpoint_and_attempts(zctx: zmq.asyncio.Context) -> None:
    client = RpcClient(zctx, "tcp://127.0.0.1:9", client_id="c")  # port 9 (discard): nothing listens
    with pytest.raises(
        RpcTimeout, match=r"RPC LeaseRenew to tcp://127.0.0.1:9: no reply after 3 attempt\(s\) of 0.1s"
    ):
        await client.call(LeaseRenew(lease_id="L1"), timeout=0.1, retries=2)
    client.close()


@pytest.mark.integration
async def test_malformed_requests_are_counted_and_answered_with_their_reason(
    zctx: zmq.asyncio.Context, served: tuple[RpcServer, Echo]
) -> None:
    server, handler = served
    raw = zctx.socket(zmq.DEALER)
    raw.connect(server.endpoint)
    await raw.send_multipart([b"r1", b"\xc1"])
    await raw.send_multipart([b"r2", msgpack.packb({"type": "LeaseRenew", "v": 1})])
    await raw.send_multipart([b"r3", msgpack.packb({"type": "LeaseRenew", "v": 5, "lease_id": "x"})])
    await raw.send(b"just one frame")
    replies = dict([await asyncio.wait_for(raw.recv_multipart(), 5) for _ in range(3)])
    assert {key: decode(value).reason for key, value in replies.items()} == {
        b"r1": "bad_msgpack",
        b"r2": "bad_schema",
        b"r3": "bad_version",
    }
    assert server.dropped == {"bad_msgpack": 1, "bad_schema": 1, "bad_version": 1, "bad_envelope": 1}
    assert handler.calls == []
    raw.close(linger=0)


@pytest.mark.integration
async def test_client_survives_a_server_restart_on_the_same_address(zctx: zmq.asyncio.Context, ipc_dir) -> None:
    address = f"ipc://{ipc_dir}/rpc.sock"
    first = RpcServer(zctx, address)
    serving = asyncio.create_task(first.serve(Echo()))
    client = RpcClient(zctx, address, client_id="c")
    assert (await client.call(LeaseRenew(lease_id="a"))).ok
    first.close()
    await serving
    second = RpcServer(zctx, address)
    serving = asyncio.create_task(second.serve(Echo()))
    assert (await client.call(LeaseRenew(lease_id="b"), timeout=0.5, retries=8)).error == "c:b"
    client.close()
    second.close()
    await serving


@pytest.mark.integration
async def test_closing_the_client_fails_a_waiting_call_as_closed_not_cancelled(zctx: zmq.asyncio.Context) -> None:
    server, handler = RpcServer(zctx, "tcp://127.0.0.1:0"), Echo(delay=5.0)
    serving = asyncio.create_task(server.serve(handler))
    client = RpcClient(zctx, server.endpoint, client_id="c")
    waiting = asyncio.create_task(client.call(LeaseRenew(lease_id="slow"), timeout=5, retries=0))
    await asyncio.sleep(0.2)
    client.close()
    with pytest.raises(RpcClosed, match=r"RPC client c to tcp://127\.0\.0\.1:[0-9]+ was closed"):
        await asyncio.wait_for(waiting, 5)
    server.close()
    await serving


@pytest.mark.integration
async def test_closing_the_client_mid_send_fails_the_call_as_closed_not_cancelled(zctx: zmq.asyncio.Context) -> None:
    """A DEALER with no connected server blocks in send; closing it then cancels pyzmq's send future, which must
    surface as RpcClosed: a bare CancelledError would end the caller's task as if it had been told to stop."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        nobody = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    client = RpcClient(zctx, nobody, client_id="c")
    waiting = asyncio.create_task(client.call(LeaseRenew(lease_id="never"), timeout=5, retries=0))
    await asyncio.sleep(0.2)
    assert not waiting.done()
    client.close()
    with pytest.raises(RpcClosed, match="was closed"):
        await asyncio.wait_for(waiting, 5)
    assert not waiting.cancelled()
