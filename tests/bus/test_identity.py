"""A client that presents another actor's name cannot cut that actor off (issue #16, defect 1).

Routing ids carry a per-connection nonce and binding sockets never hand a live id over, so a spoofer, even one
that somehow learned the exact routing id, is refused by libzmq while the real connection carries on.
"""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from bus.rpc import RpcClient, RpcServer
from bus.schema import Ack, LeaseRenew
from bus.sockets import peer_name
from bus.stream import StreamReceiver, StreamSender


async def _ack(client: str, request: object) -> Ack:
    return Ack(ok=True, error=peer_name(client))


async def _spoof(zctx: zmq.asyncio.Context, endpoint: str, ident: bytes) -> None:
    """Connect as `ident`, send one invalid frame, linger a moment, disconnect: the probe of the issue."""
    spoofer = zctx.socket(zmq.DEALER)
    spoofer.setsockopt(zmq.ROUTING_ID, ident)
    spoofer.setsockopt(zmq.LINGER, 0)
    spoofer.connect(endpoint)
    await spoofer.send_multipart([b"\x01", b"not msgpack"])
    await asyncio.sleep(0.3)
    spoofer.close(linger=0)
    await asyncio.sleep(0.3)


@pytest.mark.integration
async def test_a_spoofed_rpc_identity_changes_nothing_for_the_real_client(zctx: zmq.asyncio.Context) -> None:
    server = RpcServer(zctx, "tcp://127.0.0.1:0")
    serving = asyncio.create_task(server.serve(_ack))
    client = RpcClient(zctx, server.endpoint, client_id="learner")
    assert await client.call(LeaseRenew(lease_id="before"), timeout=2, retries=0) == Ack(ok=True, error="learner")
    real_ident = client._sock.getsockopt(zmq.ROUTING_ID)
    for ident in (b"learner", real_ident):  # the name anyone can guess, and the exact id of the live connection
        await _spoof(zctx, server.endpoint, ident)
        for _ in range(3):
            reply = await client.call(LeaseRenew(lease_id="after"), timeout=1.0, retries=0)
            assert reply == Ack(ok=True, error="learner"), f"the real client lost its replies to a spoof as {ident!r}"
    client.close()
    server.close()
    await serving


@pytest.mark.integration
async def test_a_spoofed_stream_identity_changes_nothing_for_the_real_sender(zctx: zmq.asyncio.Context) -> None:
    receiver = StreamReceiver(zctx, "tcp://127.0.0.1:0", window=4)
    received: asyncio.Queue[tuple[str, object]] = asyncio.Queue()

    async def consume() -> None:
        while True:
            received.put_nowait(await receiver.recv())

    consuming = asyncio.create_task(consume())
    sender = StreamSender(zctx, sender_id="rollout-0-0")
    sender.connect("reward", receiver.endpoint)
    await sender.send(LeaseRenew(lease_id="0"), timeout=2)
    assert await asyncio.wait_for(received.get(), 2) == ("rollout-0-0", LeaseRenew(lease_id="0"))
    real_ident = sender._peers["reward"].sock.getsockopt(zmq.ROUTING_ID)
    for round_, ident in enumerate((b"rollout-0-0", real_ident)):
        await _spoof(zctx, receiver.endpoint, ident)
        for index in range(10):  # more than a window: credits must keep coming back to the real sender
            lease_id = f"{round_}.{index}"
            await sender.send(LeaseRenew(lease_id=lease_id), timeout=2)
            assert await asyncio.wait_for(received.get(), 2) == ("rollout-0-0", LeaseRenew(lease_id=lease_id))
    consuming.cancel()
    sender.close()
    receiver.close()
