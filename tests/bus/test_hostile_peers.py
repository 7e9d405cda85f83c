"""Hostile peers on bound sockets (issue #17): drops counted per peer in bounded tables, credit abuse refused,
per-client queues and frame sizes capped, garbage kept out of the RPC reply cache, subscription floods defused."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import sys
from collections.abc import Callable

import msgpack
import pytest
import zmq
import zmq.asyncio

from bus.broadcast import MAX_TOPIC_BYTES, Publisher, Subscriber
from bus.codec import decode, encode
from bus.rpc import MAX_QUEUED_PER_CLIENT, REQUEST_LIMITS, RpcServer
from bus.schema import Ack, Control, Heartbeat, LeaseRenew, StreamHello, VersionAnnouncement
from bus.sockets import OTHER_PEERS, DropLog, routing_id
from bus.stream import StreamReceiver, StreamSender
from tests.support.waiting import until

log = logging.getLogger(__name__)


def _dealer(zctx: zmq.asyncio.Context, endpoint: str, ident: bytes | None = None) -> zmq.asyncio.Socket:
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if ident is not None:
        sock.setsockopt(zmq.ROUTING_ID, ident)
    sock.connect(endpoint)
    return sock


# ------------------------------------------------------------------------------------------------ DropLog
@pytest.mark.unit
def test_a_flood_of_fresh_identities_folds_into_other_and_keeps_the_heavy_sender() -> None:
    drops = DropLog(log, "test", max_peers=8)
    for _ in range(50):
        drops("bad_msgpack", "x", b"mallory#0123456789abcdef")
    for index in range(10_000):
        drops("bad_schema", "x", f"random-{index}".encode())
    table = drops.peers()
    assert len(table) <= 9  # eight rows and (other), whatever the number of identities
    assert table["mallory"] == {"bad_msgpack": 50}  # the heaviest sender keeps its exact row
    assert sum(sum(row.values()) for row in table.values()) == 10_050 == sum(drops.counts.values())
    assert table[OTHER_PEERS]["bad_schema"] >= 10_000 - 8


@pytest.mark.unit
def test_peer_labels_are_safe_metric_keys() -> None:
    drops = DropLog(log, "test")
    drops("bad_envelope", "x", b"\x00k\x8b\x01\x02")  # the anonymous id libzmq gives a client that set none
    drops("bad_envelope", "x", "evil.name\nwith/slashes" + "z" * 200)
    drops("bad_envelope", "x", routing_id("rollout-0-0", "test"))
    metrics = drops.metrics("inbox")
    assert metrics["dropped.inbox.bad_envelope"] == 3.0
    assert metrics["dropped_by.inbox.(anonymous).bad_envelope"] == 1.0
    assert metrics["dropped_by.inbox.rollout-0-0.bad_envelope"] == 1.0
    odd = [key for key in metrics if key.startswith("dropped_by.inbox.evil")]
    assert odd == ["dropped_by.inbox.evil.name_with_slashes" + "z" * 42 + ".bad_envelope"]


# ------------------------------------------------------------------------------------------------- stream
@pytest.mark.integration
async def test_stream_drops_are_counted_per_sender(zctx: zmq.asyncio.Context) -> None:
    receiver = StreamReceiver(zctx, "tcp://127.0.0.1:0")
    mallory = _dealer(zctx, receiver.endpoint, routing_id("mallory", "test"))
    eve = _dealer(zctx, receiver.endpoint, b"eve")
    for _ in range(3):
        await mallory.send(b"\xc1")
    await eve.send_multipart([b"a", b"b"])
    await eve.send(encode(Heartbeat(actor_id="eve", seq=1)))  # after eve's garbage on the same connection
    await mallory.send(encode(Heartbeat(actor_id="mallory", seq=1)))
    got = {(await asyncio.wait_for(receiver.recv(), 5))[0] for _ in range(2)}
    assert got == {"eve", "mallory"}
    assert receiver.dropped_by_peer() == {"mallory": {"bad_msgpack": 3}, "eve": {"bad_envelope": 1}}
    receiver.close()


@pytest.mark.integration
async def test_data_without_a_session_gets_no_more_than_a_restart_can_leave_in_flight(
    zctx: zmq.asyncio.Context,
) -> None:
    """A sender that skips the hello ignores credit altogether: after two windows (what a sender's credit from
    our previous incarnation can carry, and a window of slack) its frames are dropped as over_credit, until it
    says hello like any sender told to by the empty-session credit."""
    window = 4
    receiver = StreamReceiver(zctx, "tcp://127.0.0.1:0", window=window)
    greedy = _dealer(zctx, receiver.endpoint, b"greedy")
    for seq in range(100):
        await greedy.send(encode(Heartbeat(actor_id="greedy", seq=seq)))
    await greedy.send(encode(StreamHello(sender_id="greedy", session="s1")))
    await greedy.send(encode(Heartbeat(actor_id="greedy", seq=100)))
    delivered = [(await asyncio.wait_for(receiver.recv(), 5))[1].seq for _ in range(2 * window + 1)]
    assert delivered == [*range(2 * window), 100]
    assert receiver.dropped_by_peer() == {"greedy": {"over_credit": 100 - 2 * window}}
    receiver.close()

# ----------------------------------------------------------------------------------------------------- RPC
class _Counting:
    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, client: str, request: object) -> Ack:
        self.calls += 1
        return Ack(ok=True, error=str(self.calls))


@pytest.mark.integration
async def test_garbage_requests_do_not_evict_cached_replies(zctx: zmq.asyncio.Context) -> None:
    server = RpcServer(zctx, "tcp://127.0.0.1:0", reply_cache_entries=4)
    handler = _Counting()
    serving = asyncio.create_task(server.serve(handler))
    client = _dealer(zctx, server.endpoint, b"learner")
    request = encode(LeaseRenew(lease_id="L1"))
    await client.send_multipart([b"call-1", request])
    first = decode((await asyncio.wait_for(client.recv_multipart(), 5))[1])
    hostile = _dealer(zctx, server.endpoint, b"mallory")
    for index in range(50):
        await hostile.send_multipart([f"junk-{index}".encode(), b"\xc1"])
    for _ in range(50):
        await asyncio.wait_for(hostile.recv_multipart(), 5)  # each is answered with its reason
    await client.send_multipart([b"call-1", request])  # the retry of a call whose reply was lost
    retry = decode((await asyncio.wait_for(client.recv_multipart(), 5))[1])
    assert retry == first and handler.calls == 1, "the retry ran the handler again: its reply was evicted"
    assert server.dropped_by_peer() == {"mallory": {"bad_msgpack": 50}}
    assert server.drop_metrics("rpc")["duplicates.rpc"] == 1.0
    server.close()
    await serving


@pytest.mark.integration
async def test_rpc_requests_over_the_request_limit_are_refused_before_decoding(zctx: zmq.asyncio.Context) -> None:
    server = RpcServer(zctx, "tcp://127.0.0.1:0")
    handler = _Counting()
    serving = asyncio.create_task(server.serve(handler))
    big = _dealer(zctx, server.endpoint, b"big")
    huge = encode(Heartbeat(actor_id="x" * (REQUEST_LIMITS.max_frame_bytes + 1), seq=1))
    await big.send_multipart([b"r1", huge])
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(big.recv_multipart(), 1.0)  # libzmq dropped it (and the connection) unread
    assert handler.calls == 0
    small = _dealer(zctx, server.endpoint, b"small")
    await small.send_multipart([b"r2", encode(LeaseRenew(lease_id="L"))])
    assert decode((await asyncio.wait_for(small.recv_multipart(), 5))[1]) == Ack(ok=True, error="1")
    server.close()
    await serving


@pytest.mark.integration
async def test_requests_queued_per_client_are_capped(zctx: zmq.asyncio.Context) -> None:
    """A client that floods requests while every handler slot is busy fills its own queue, then must wait."""
    release = asyncio.Event()

    async def blocked(client: str, request: object) -> Ack:
        await release.wait()
        return Ack()

    server = RpcServer(zctx, "inproc://hostile-rpc", max_concurrency=1)
    serving = asyncio.create_task(server.serve(blocked))
    owner = zctx.socket(zmq.DEALER)
    flooder = zmq.Socket.shadow(owner.underlying)  # plain sends: NOBLOCK raises at once instead of in a future
    flooder.setsockopt(zmq.SNDHWM, 1)
    flooder.setsockopt(zmq.LINGER, 0)
    flooder.connect("inproc://hostile-rpc")
    await asyncio.sleep(0.1)
    accepted = 0
    for index in range(1000):
        try:
            flooder.send_multipart([f"r{index}".encode(), encode(LeaseRenew(lease_id="x"))], zmq.NOBLOCK)
        except zmq.Again:
            await asyncio.sleep(0.05)  # let the server take what it will, then try once more
            try:
                flooder.send_multipart([f"r{index}".encode(), encode(LeaseRenew(lease_id="x"))], zmq.NOBLOCK)
            except zmq.Again:
                break
        accepted += 1
    # inproc queues hold the sender's SNDHWM plus the server's RCVHWM; the server holds one in its handler.
    assert accepted <= MAX_QUEUED_PER_CLIENT + 4, f"{accepted} requests queued for one client"
    release.set()
    owner.close(linger=0)
    server.close()
    await serving


# ------------------------------------------------------------------------------------------------ publisher
async def _subscriber_socket(zctx: zmq.asyncio.Context, publisher: Publisher) -> zmq.asyncio.Socket:
    xsub = zctx.socket(zmq.XSUB)
    xsub.setsockopt(zmq.LINGER, 0)
    xsub.connect(publisher.endpoint)
    await asyncio.sleep(0.1)
    return xsub


@pytest.mark.integration
async def test_a_subscription_longer_than_any_topic_is_refused_with_its_connection(
    zctx: zmq.asyncio.Context,
) -> None:
    publisher = Publisher(zctx, "tcp://127.0.0.1:0")
    publisher.publish("version", VersionAnnouncement(version=1))
    xsub = await _subscriber_socket(zctx, publisher)
    await xsub.send(b"\x01" + secrets.token_bytes(1000))  # libzmq would keep ~50 KB of trie for this one
    await xsub.send(b"\x01version")  # same connection: never seen, the connection is gone
    await asyncio.sleep(0.3)
    assert publisher.replayed == 0
    honest = await _subscriber_socket(zctx, publisher)
    await honest.send(b"\x01version")
    await until(lambda: publisher.replayed == 1, "the honest subscription's replay")
    assert publisher.subscriptions == 1
    with pytest.raises(ValueError, match=f"topics are at most {MAX_TOPIC_BYTES}"):
        publisher.publish("t" * (MAX_TOPIC_BYTES + 1), Control(command="pause"))
    publisher.close()


@pytest.mark.integration
async def test_a_subscription_flood_does_not_become_a_broadcast_flood(zctx: zmq.asyncio.Context) -> None:
    publisher = Publisher(zctx, "tcp://127.0.0.1:0")
    publisher.publish("version", VersionAnnouncement(version=3))
    publisher.publish("control", Control(command="resume"))
    flooder = await _subscriber_socket(zctx, publisher)
    for _ in range(500):
        await flooder.send(b"\x01")  # everything: a replay of every topic, to every subscriber, each time
    started = asyncio.get_running_loop().time()
    await until(lambda: publisher.subscriptions == 500, "all 500 subscriptions to reach the publisher")
    await asyncio.sleep(0.5)  # and the replays they could set off meanwhile
    window = asyncio.get_running_loop().time() - started
    assert publisher.replayed <= 2 * 2 * (1 + window / 0.05), f"{publisher.replayed} replays for 500 subscriptions"
    late = Subscriber(zctx, publisher.endpoint, ["version"])  # a late joiner still gets the current state
    topic, message = await asyncio.wait_for(late.recv(), 5)
    assert (topic, message) == ("version", VersionAnnouncement(version=3))
    late.close()
    publisher.close()


@pytest.mark.integration
async def test_frames_that_are_not_subscriptions_are_counted(zctx: zmq.asyncio.Context) -> None:
    publisher = Publisher(zctx, "tcp://127.0.0.1:0")
    publisher.publish("version", VersionAnnouncement(version=1))
    xsub = await _subscriber_socket(zctx, publisher)
    await xsub.send(msgpack.packb({"type": "Control", "v": 1, "command": "stop"}))
    await xsub.send(b"\x02junk")
    await xsub.send_multipart([b"\x02two", b"frames"])
    await xsub.send_multipart([b"\x01version", b"tail"])  # a subscription, then a frame that is not one
    await until(lambda: sum(publisher.dropped.values()) == 4, "the four frames that are not subscriptions")
    assert publisher.subscriptions == 1
    assert publisher.dropped == {"not_subscription": 3, "bad_envelope": 1}
    assert publisher.dropped_by_peer() == {"subscriber@127.0.0.1": {"not_subscription": 3, "bad_envelope": 1}}
    publisher.close()


# ------------------------------------------------------------------------------------------------ fairness
FLOOD_DROPS = 1000  # frames a receiver drops before the flood ends: enough to have starved it before the fix
FLOOD_DEADLINE_S = 60.0
_FLOODER = """
import sys, time, zmq
endpoint, rpc, count, connections = sys.argv[1], sys.argv[2] == "rpc", int(sys.argv[3]) or 10**12, int(sys.argv[4])
ctx = zmq.Context()
socks = []
for index in range(connections):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, b"flood-%d" % index)
    sock.connect(endpoint)
    socks.append(sock)
time.sleep(0.3)
garbage = ([b"rid"] if rpc else []) + [b"\\xc1" * 64]
for index in range(count):  # count 0: until it is killed
    socks[index % connections].send_multipart(garbage)
ctx.destroy(linger=0)
"""


async def _longest_stall_during_flood(endpoint: str, channel: str, dropped: Callable[[], int],
                                      tick_s: float = 0.005) -> float:
    """The longest the event loop went without running this task while another process floods ``endpoint``, until
    the receiver has dropped `FLOOD_DROPS` of its frames: the flood lasts until then, however fast the machine.

    The flood comes from another process so that it keeps the receiver's queues full for as long as it lasts.
    """
    flooder = await asyncio.create_subprocess_exec(sys.executable, "-c", _FLOODER, endpoint, channel, "0", "50")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + FLOOD_DEADLINE_S
    longest, last = 0.0, loop.time()
    try:
        while dropped() <= FLOOD_DROPS:
            assert flooder.returncode is None, f"the flooder exited ({flooder.returncode}) after {dropped()} drops"
            assert loop.time() < deadline, f"{dropped()} of {FLOOD_DROPS} frames dropped in {FLOOD_DEADLINE_S:.0f}s"
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(flooder.wait(), tick_s)
            now = loop.time()
            longest, last = max(longest, now - last - tick_s), now
    finally:
        if flooder.returncode is None:
            flooder.kill()
        await flooder.wait()
    return longest


@pytest.mark.integration
async def test_a_garbage_flood_does_not_starve_the_receivers_other_tasks(zctx: zmq.asyncio.Context) -> None:
    """Found by tools/hostile/campaign.py: an actor busy dropping a flood never yielded to its other tasks, so its
    heartbeats stopped and the controller declared it dead."""
    receiver = StreamReceiver(zctx, "tcp://127.0.0.1:0")
    consumer = asyncio.create_task(receiver.recv())  # drops frame after frame, waiting for a valid one
    try:
        stall = await _longest_stall_during_flood(receiver.endpoint, "stream", lambda: receiver.dropped["bad_msgpack"])
    finally:
        consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)
        receiver.close()
    assert stall < 0.5, f"the event loop stalled {stall:.2f}s while the receiver dropped garbage"


@pytest.mark.integration
async def test_a_request_flood_does_not_starve_the_servers_other_tasks(zctx: zmq.asyncio.Context) -> None:
    server = RpcServer(zctx, "tcp://127.0.0.1:0")
    serving = asyncio.create_task(server.serve(_Counting()))
    try:
        stall = await _longest_stall_during_flood(server.endpoint, "rpc", lambda: server.dropped["bad_msgpack"])
    finally:
        server.close()
        await serving
    assert stall < 0.5, f"the event loop stalled {stall:.2f}s while the server dropped garbage"


@pytest.mark.integration
async def test_a_flood_of_new_senders_forgets_idle_accounts_before_active_ones(
    zctx: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The account table is bounded; when it is full, the sender granted credit most recently is kept longest,
    so a flood of hellos from fresh connections does not keep resetting the sessions of senders at work."""
    monkeypatch.setattr("bus.stream.MAX_SENDER_ACCOUNTS", 3)
    receiver = StreamReceiver(zctx, "tcp://127.0.0.1:0", window=4)
    received: asyncio.Queue[tuple[str, object]] = asyncio.Queue()

    async def consume() -> None:
        while True:
            received.put_nowait(await receiver.recv())

    consuming = asyncio.create_task(consume())
    active = StreamSender(zctx, sender_id="active")
    active.connect("r", receiver.endpoint)  # the first account
    await active.send(Heartbeat(actor_id="active", seq=0), timeout=5)
    await asyncio.wait_for(received.get(), 5)
    strangers = [_dealer(zctx, receiver.endpoint, f"stranger-{index}".encode()) for index in range(4)]
    for index, stranger in enumerate(strangers):
        await stranger.send(encode(StreamHello(sender_id="s", session=f"s{index}")))
        await asyncio.sleep(0.1)
        if index == 1:  # the active sender keeps working while the strangers arrive: its credit is renewed
            await active.send(Heartbeat(actor_id="active", seq=1), timeout=5)
            await asyncio.wait_for(received.get(), 5)
            await asyncio.sleep(0.1)
    names = [account.name for account in receiver._accounts.values()]
    consuming.cancel()
    await asyncio.gather(consuming, return_exceptions=True)
    for stranger in strangers:
        stranger.close(linger=0)
    active.close()
    receiver.close()
    assert len(names) == 3 and "active" in names, names
