"""Broadcast channel over real sockets: late joiners get the current state, each message arrives once."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from bus.broadcast import Publisher, Subscriber
from bus.codec import encode
from bus.schema import Control, VersionAnnouncement


async def _next(subscriber: Subscriber) -> tuple[str, object]:
    return await asyncio.wait_for(subscriber.recv(), 5)


async def _nothing_more(subscriber: Subscriber, wait: float = 0.2) -> bool:
    try:
        await asyncio.wait_for(subscriber.recv(), wait)
    except asyncio.TimeoutError:
        return True
    return False


@pytest.mark.integration
async def test_a_late_subscriber_gets_the_current_state_at_once(zctx: zmq.asyncio.Context, bind: str) -> None:
    publisher = Publisher(zctx, bind)
    for version in (1, 2, 3):
        publisher.publish("version", VersionAnnouncement(version=version))
    publisher.publish("control", Control(command="pause", reason="checkpoint"))
    late = Subscriber(zctx, publisher.endpoint, ["version", "control"])
    received = {topic: message for topic, message in [await _next(late), await _next(late)]}
    assert received == {
        "version": VersionAnnouncement(version=3),
        "control": Control(command="pause", reason="checkpoint"),
    }
    assert await _nothing_more(late)
    publisher.close()
    late.close()


@pytest.mark.integration
async def test_replays_for_a_newcomer_are_not_delivered_twice_to_others(zctx: zmq.asyncio.Context) -> None:
    publisher = Publisher(zctx, "tcp://127.0.0.1:0")
    first = Subscriber(zctx, publisher.endpoint, ["version"])
    await asyncio.sleep(0.1)  # first's subscription reaches the publisher
    publisher.publish("version", VersionAnnouncement(version=1))
    assert (await _next(first))[1] == VersionAnnouncement(version=1)
    second = Subscriber(zctx, publisher.endpoint, ["version"])  # triggers a replay to every "version" subscriber
    assert (await _next(second))[1] == VersionAnnouncement(version=1)
    publisher.publish("version", VersionAnnouncement(version=2))
    assert (await _next(first))[1] == VersionAnnouncement(version=2)  # not the replayed 1
    assert first.duplicates >= 1
    for channel in (publisher, first, second):
        channel.close()


@pytest.mark.integration
async def test_topics_are_exact_names_not_prefixes(zctx: zmq.asyncio.Context) -> None:
    publisher = Publisher(zctx, "tcp://127.0.0.1:0")
    publisher.publish("version_debug", VersionAnnouncement(version=99))
    publisher.publish("version", VersionAnnouncement(version=4))
    subscriber = Subscriber(zctx, publisher.endpoint, ["version"])
    assert await _next(subscriber) == ("version", VersionAnnouncement(version=4))
    assert await _nothing_more(subscriber)
    publisher.close()
    subscriber.close()


@pytest.mark.integration
async def test_one_subscriber_follows_several_publishers(zctx: zmq.asyncio.Context) -> None:
    a, b = Publisher(zctx, "tcp://127.0.0.1:0"), Publisher(zctx, "tcp://127.0.0.1:0")
    a.publish("control", Control(command="pause"))
    b.publish("control", Control(command="resume"))
    subscriber = Subscriber(zctx, a.endpoint, ["control"])
    subscriber.connect(b.endpoint)
    commands = {(await _next(subscriber))[1].command for _ in range(2)}
    assert commands == {"pause", "resume"}
    for channel in (a, b, subscriber):
        channel.close()


@pytest.mark.integration
async def test_malformed_publications_are_counted_and_skipped(zctx: zmq.asyncio.Context) -> None:
    rogue = zctx.socket(zmq.XPUB)
    rogue.bind("tcp://127.0.0.1:0")
    subscriber = Subscriber(zctx, rogue.getsockopt_string(zmq.LAST_ENDPOINT), ["control"])
    await asyncio.wait_for(rogue.recv(), 5)  # the subscription arrived
    stamp = bytes(8) + (1).to_bytes(8, "big")
    await rogue.send_multipart([b"control", b"short", b"x"])
    await rogue.send_multipart([b"control", stamp, b"\xc1"])
    # A good frame after the garbage, on the same connection, so it cannot overtake it.
    await rogue.send_multipart([b"control", bytes(8) + (2).to_bytes(8, "big"), encode(Control(command="stop"))])
    assert (await _next(subscriber))[1] == Control(command="stop")
    assert subscriber.dropped == {"bad_envelope": 1, "bad_msgpack": 1}
    rogue.close(linger=0)
    subscriber.close()
