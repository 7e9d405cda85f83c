"""An actor written from docs/wire-protocol.md alone: raw pyzmq and msgpack, no bus code on its side.

Everything the foreign actor sends is a hand-built msgpack map with hand-packed tensor ext payloads, and
everything it receives it parses the same way. The bus objects in these tests are only its counterparts.
"""

from __future__ import annotations

import asyncio
import secrets
import struct
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
import zmq.asyncio

from bus.broadcast import Publisher
from bus.rpc import RpcClient, RpcServer
from bus.schema import Ack, LeaseRenew, Member, Register, Registered, Roster, ScoredGroup, VersionAnnouncement
from bus.sockets import peer_name
from bus.stream import StreamReceiver, StreamSender

# ----------------------------------------------------------------------------- the foreign actor's own codec


def tensor_ext(dtype: str, shape: list[int], elements: bytes) -> msgpack.ExtType:
    """Section 2: u8 dtype_len, dtype, u8 ndim, ndim x u64 LE, little-endian elements; ext type 1."""
    header = bytes([len(dtype)]) + dtype.encode("ascii") + bytes([len(shape)]) + struct.pack(f"<{len(shape)}Q", *shape)
    return msgpack.ExtType(1, header + elements)


def parse_tensor(code: int, payload: bytes) -> tuple[str, list[int], bytes]:
    dtype_len = payload[0]
    dtype = payload[1 : 1 + dtype_len].decode("ascii")
    ndim = payload[1 + dtype_len]
    shape = list(struct.unpack_from(f"<{ndim}Q", payload, 2 + dtype_len))
    return dtype, shape, payload[2 + dtype_len + 8 * ndim :]


def pack(message: dict[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(frame: bytes) -> dict[str, Any]:
    return msgpack.unpackb(frame, raw=False, ext_hook=lambda code, data: parse_tensor(code, data))


def foreign_sample(index: int) -> dict[str, Any]:
    prompt, response = [11, 12, 13], [40 + index, 41 + index]
    return {
        "type": "Sample",
        "v": 1,
        "sample_id": f"g7/{index}",
        "group_id": "g7",
        "index": index,
        "prompt": [{"role": "user", "content": "2+2?"}],
        "prompt_tokens": len(prompt),
        "tokens": tensor_ext("int32", [5], struct.pack("<5i", *prompt, *response)),
        "response": "4",
        "response_length": 2,
        "label": "4",
        "reward": 1.0,
        "rollout_log_probs": tensor_ext("float32", [2], struct.pack("<2f", -0.25, -0.5)),
        "token_versions": tensor_ext("int32", [2], struct.pack("<2i", 3, 3)),
        "loss_mask": tensor_ext("uint8", [2], b"\x01\x01"),
        "status": "completed",
        "metadata": {"env": "rust-calculator"},
    }


# ----------------------------------------------------------------------------- tests


@pytest.mark.integration
async def test_foreign_producer_streams_scored_groups_within_its_credit(zctx: zmq.asyncio.Context) -> None:
    receiver = StreamReceiver(zctx, "tcp://127.0.0.1:0", window=2)
    dealer = zctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.ROUTING_ID, b"env-rust-0")  # section 4: routing id = sender id
    dealer.connect(receiver.endpoint)
    session = secrets.token_hex(8)
    await dealer.send(pack({"type": "StreamHello", "v": 1, "sender_id": "env-rust-0", "session": session}))
    first_take = asyncio.create_task(receiver.recv())  # the consumer's application is waiting for work
    credit = unpack(await asyncio.wait_for(dealer.recv(), 5))
    assert credit["type"] == "StreamCredit" and credit["session"] == session and credit["limit"] == 2

    for index in range(credit["limit"]):  # send exactly what the credit allows
        group = {"type": "ScoredGroup", "v": 1, "lease_id": "L1", "group_id": "g7", "worker_id": "env-rust-0",
                 "samples": [foreign_sample(index)]}  # fmt: skip
        await dealer.send(pack(group))
    who, message = await asyncio.wait_for(first_take, 5)
    assert who == "env-rust-0" and isinstance(message, ScoredGroup)
    sample = message.samples[0]
    np.testing.assert_array_equal(sample.tokens, [11, 12, 13, 40, 41])
    np.testing.assert_array_equal(sample.rollout_log_probs, np.array([-0.25, -0.5], np.float32))
    assert sample.tokens.dtype == np.int32 and sample.prompt[0]["content"] == "2+2?"

    await asyncio.wait_for(receiver.recv(), 5)  # asking for the next message returns the first one's credit
    more = unpack(await asyncio.wait_for(dealer.recv(), 5))
    assert more["limit"] > credit["limit"] and more["incarnation"] == credit["incarnation"]
    dealer.close(linger=0)
    receiver.close()


@pytest.mark.integration
async def test_foreign_consumer_grants_credit_to_a_bus_producer(zctx: zmq.asyncio.Context) -> None:
    router = zctx.socket(zmq.ROUTER)
    router.bind("tcp://127.0.0.1:0")
    sender = StreamSender(zctx, sender_id="rollout-0")
    sender.connect("env", router.getsockopt_string(zmq.LAST_ENDPOINT))
    sending = asyncio.create_task(sender.send(LeaseRenew(lease_id="L5"), timeout=5))
    ident, frame = await asyncio.wait_for(router.recv_multipart(), 5)
    hello = unpack(frame)
    assert (peer_name(ident), hello["type"], hello["sender_id"]) == ("rollout-0", "StreamHello", "rollout-0")
    assert ident.startswith(b"rollout-0#"), "a bus producer's routing id is its id plus a per-connection nonce"
    credit = {"type": "StreamCredit", "v": 1, "limit": 1, "window": 1, "incarnation": "env-1",
              "session": hello["session"]}  # fmt: skip
    await router.send_multipart([ident, pack(credit)])
    ident, frame = await asyncio.wait_for(router.recv_multipart(), 5)
    assert unpack(frame) == {"type": "LeaseRenew", "v": 1, "lease_id": "L5"}
    assert await sending == "env"
    router.close(linger=0)
    sender.close()


@pytest.mark.integration
async def test_foreign_actor_registers_over_rpc(zctx: zmq.asyncio.Context) -> None:
    async def controller(client: str, request: Any) -> Registered:
        assert isinstance(request, Register)
        member = Member(actor_id=request.actor_id, role=request.role, node=request.node, pid=request.pid,
                        endpoints=request.endpoints)  # fmt: skip
        roster = Roster(generation=1, members=[member])
        return Registered(roster=roster, publish_endpoint="tcp://head:7001", heartbeat_interval=1.0, deadline=5.0)

    server = RpcServer(zctx, "tcp://127.0.0.1:0")
    serving = asyncio.create_task(server.serve(controller))
    dealer = zctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.ROUTING_ID, b"env-rust-0")
    dealer.connect(server.endpoint)
    register = {"type": "Register", "v": 1, "actor_id": "env-rust-0", "role": "environment", "node": "box",
                "pid": 4242, "endpoints": {"rpc": "tcp://box:9000"}, "meta": {"language": "rust"}}  # fmt: skip
    await dealer.send_multipart([b"\x00\x01request-1", pack(register)])  # section 5: [request_id, message]
    request_id, frame = await asyncio.wait_for(dealer.recv_multipart(), 5)
    reply = unpack(frame)
    assert request_id == b"\x00\x01request-1"
    assert reply["type"] == "Registered" and reply["publish_endpoint"] == "tcp://head:7001"
    assert reply["roster"]["type"] == "Roster"
    assert reply["roster"]["members"] == [
        {"actor_id": "env-rust-0", "role": "environment", "node": "box", "pid": 4242,
         "endpoints": {"rpc": "tcp://box:9000"}, "alive": True, "incarnation": 0, "policy": None}
    ]  # fmt: skip
    dealer.close(linger=0)
    server.close()
    await serving


@pytest.mark.integration
async def test_foreign_rpc_server_answers_a_bus_client(zctx: zmq.asyncio.Context) -> None:
    router = zctx.socket(zmq.ROUTER)
    router.bind("tcp://127.0.0.1:0")
    client = RpcClient(zctx, router.getsockopt_string(zmq.LAST_ENDPOINT), client_id="learner")
    calling = asyncio.create_task(client.call(LeaseRenew(lease_id="L2")))
    ident, request_id, frame = await asyncio.wait_for(router.recv_multipart(), 5)
    assert peer_name(ident) == "learner" and unpack(frame)["lease_id"] == "L2"
    await router.send_multipart([ident, request_id, pack({"type": "Ack", "v": 1, "ok": False, "error": "expired"})])
    assert await calling == Ack(ok=False, error="expired")
    router.close(linger=0)
    client.close()


@pytest.mark.integration
async def test_foreign_subscriber_reads_the_current_version_and_drops_replays(zctx: zmq.asyncio.Context) -> None:
    publisher = Publisher(zctx, "tcp://127.0.0.1:0")
    publisher.publish("version", VersionAnnouncement(version=6, weights_version=6, step=6, timestamp=1.5))
    sub = zctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"version")
    sub.connect(publisher.endpoint)
    seen: dict[tuple[bytes, bytes], int] = {}

    async def next_new() -> tuple[bytes, dict[str, Any]]:
        while True:
            topic, stamp, frame = await asyncio.wait_for(sub.recv_multipart(), 5)  # section 6
            key, sequence = (topic, stamp[:8]), int.from_bytes(stamp[8:], "big")
            if topic == b"version" and sequence > seen.get(key, 0):
                seen[key] = sequence
                return topic, unpack(frame)

    topic, message = await next_new()  # the replay of the last value, right after subscribing
    assert topic == b"version" and message == {"type": "VersionAnnouncement", "v": 1, "version": 6,
                                               "weights_version": 6, "step": 6, "timestamp": 1.5,
                                               "policy": None}  # fmt: skip
    other = zctx.socket(zmq.SUB)  # a second subscriber makes the publisher replay version 6 to everyone
    other.setsockopt(zmq.SUBSCRIBE, b"version")
    other.connect(publisher.endpoint)
    await asyncio.wait_for(other.recv_multipart(), 5)
    publisher.publish("version", VersionAnnouncement(version=7))
    assert (await next_new())[1]["version"] == 7
    for sock in (sub, other):
        sock.close(linger=0)
    publisher.close()
