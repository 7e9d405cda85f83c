"""Broadcast channel: XPUB with a last-value cache, so a subscriber that joins late still gets the current state.

Frames (see docs/wire-protocol.md, "Broadcast"): ``[topic, stamp, message]``; ``stamp`` is 16 bytes, the
publisher's random 8-byte id followed by a big-endian u64 sequence number per topic. When a subscription
for a topic reaches the publisher (XPUB_VERBOSE, so every subscriber's subscription does), the publisher
re-sends the last message of every topic it matches. XPUB re-sends to every matching subscriber, so the
subscriber drops stamps it has already seen: each published message is delivered at most once per
subscriber, and a late joiner gets the latest one. Messages on these topics are states (a version, a roster
generation, a run state), not events, which is why "latest" is enough. Topics are exact names: the
subscriber filters out longer topics that zmq's prefix matching lets through.

A subscriber that falls more than the send high-water mark behind loses messages (XPUB drops rather than
block the publisher for everyone); it still converges on the latest state with the next publish.

Hostile subscribers: libzmq keeps every distinct subscription prefix of a connection in a trie, at ~50 bytes per
prefix byte, for as long as the connection lasts, and offers no way to refuse one. So topics are at most
``MAX_TOPIC_BYTES`` long and the publisher's socket refuses (with the connection) any frame longer than a
subscription to such a topic: a subscription flood then costs at most a few KB per subscription it actually
sent, instead of up to 3 MB. Replays are coalesced (each topic at most once per ``REPLAY_INTERVAL_S``), because
XPUB re-sends to every subscriber, so a flood of subscriptions would otherwise become a flood of broadcasts to
every actor. Frames that are not subscriptions are counted as drops; XPUB does not say which connection sent a
frame, so they are attributed to the sender's address (``subscriber@ADDRESS``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets

import zmq
import zmq.asyncio

from bus.address import bind as bind_socket
from bus.codec import DEFAULT_LIMITS, DecodeError, DecodeLimits, decode, encode
from bus.schema import Message
from bus.security import Security
from bus.sockets import YIELD_EVERY, DropLog, make_socket, try_send

log = logging.getLogger(__name__)

STAMP_BYTES = 16
MAX_TOPIC_BYTES = 32
# A subscription is a 1-byte flag and the topic, or a ZMTP 3.1 command ("\x09SUBSCRIBE" or "\x06CANCEL" + topic).
PUBLISHER_FRAME_LIMIT = MAX_TOPIC_BYTES + 16
REPLAY_INTERVAL_S = 0.05


def _check_topic(topic: str, what: str) -> bytes:
    name = topic.encode("utf-8")
    if len(name) > MAX_TOPIC_BYTES:
        raise ValueError(f"{what}: topic {topic!r} is {len(name)} bytes; topics are at most {MAX_TOPIC_BYTES}")
    return name


class Publisher:
    """Publishes messages by topic and replays each topic's last message to new subscribers."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        bind: str,
        *,
        security: Security | None = None,
        sndhwm: int = 10_000,
    ) -> None:
        self._sock = make_socket(ctx, zmq.XPUB, security=security, server=True, max_frame_bytes=PUBLISHER_FRAME_LIMIT)
        self._sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # pass up every subscription, not only a topic's first
        self._sock.setsockopt(zmq.SNDHWM, sndhwm)
        self.endpoint = bind_socket(self._sock, bind)
        self.publisher_id = secrets.token_bytes(8)
        self._last: dict[bytes, list[bytes]] = {}
        self._seq: dict[bytes, int] = {}
        self._watcher: asyncio.Task | None = None
        self._replay_due: set[bytes] = set()
        self._replay_handle: asyncio.TimerHandle | None = None
        self._last_replay = 0.0
        self._drops = DropLog(log, f"publisher {self.endpoint}")
        self.dropped = self._drops.counts
        self.published = 0
        self.replayed = 0
        self.subscriptions = 0
        self._start_watcher()

    def dropped_by_peer(self) -> dict[str, dict[str, int]]:
        """Drops per subscriber address and reason (bounded; see ``bus.sockets.DropLog``)."""
        return self._drops.peers()

    def drop_metrics(self, channel: str) -> dict[str, float]:
        """Drop counters for a heartbeat under ``channel``, with the publications, subscriptions and replays."""
        return {
            **self._drops.metrics(channel),
            f"published.{channel}": float(self.published),
            f"subscriptions.{channel}": float(self.subscriptions),
            f"replayed.{channel}": float(self.replayed),
        }

    def publish(self, topic: str, message: Message) -> None:
        """Send ``message`` to every subscriber of ``topic`` and remember it for later subscribers."""
        if not topic:
            raise ValueError("publish: topic must be a non-empty string")
        name = _check_topic(topic, "publish")
        seq = self._seq.get(name, 0) + 1
        self._seq[name] = seq
        frames = [name, self.publisher_id + seq.to_bytes(8, "big"), encode(message)]
        self._last[name] = frames
        self._start_watcher()
        try_send(self._sock, frames)  # XPUB never blocks; a subscriber past its HWM misses this one
        self.published += 1

    def _start_watcher(self) -> None:
        if self._watcher is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # started by the first publish() inside the loop
        self._watcher = loop.create_task(self._replay_on_subscribe(), name=f"publisher-{self.endpoint}")

    async def _replay_on_subscribe(self) -> None:
        taken = 0
        while True:
            taken += 1
            if taken % YIELD_EVERY == 0:
                await asyncio.sleep(0)  # a subscription flood must not starve the rest of the controller
            frames = await self._sock.recv_multipart(copy=False)
            event = frames[0].bytes
            if len(frames) != 1:
                self._drops("bad_envelope", f"a {len(frames)}-frame message upstream", _sender(frames[0]))
                continue
            if event[:1] == b"\x00":
                continue  # an unsubscription; libzmq has applied it
            if event[:1] != b"\x01":
                self._drops("not_subscription", f"a {len(event)}-byte frame upstream", _sender(frames[0]))
                continue
            self.subscriptions += 1
            prefix = event[1:]
            for name in self._last:
                if name.startswith(prefix):
                    self._replay_due.add(name)
            self._schedule_replay()

    def _schedule_replay(self) -> None:
        """Replay the due topics now, or once REPLAY_INTERVAL_S has passed since the last replay."""
        if self._replay_handle is not None or not self._replay_due:
            return
        loop = asyncio.get_running_loop()
        delay = max(0.0, self._last_replay + REPLAY_INTERVAL_S - loop.time())
        self._replay_handle = loop.call_later(delay, self._replay)

    def _replay(self) -> None:
        self._replay_handle = None
        self._last_replay = asyncio.get_running_loop().time()
        due, self._replay_due = self._replay_due, set()
        for name in due:
            try_send(self._sock, self._last[name])
            self.replayed += 1

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        if self._replay_handle is not None:
            self._replay_handle.cancel()
        self._sock.close(linger=0)


def _sender(frame: zmq.Frame) -> str:
    """``subscriber@ADDRESS`` from a frame's metadata: XPUB tells no more about who sent it."""
    try:
        address = frame.get("Peer-Address")
    except (zmq.ZMQError, UnicodeDecodeError):
        address = ""
    return f"subscriber@{address}" if address else "subscriber"


class Subscriber:
    """Receives ``(topic, message)`` for the given topics from one or more publishers."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        topics: list[str],
        *,
        limits: DecodeLimits = DEFAULT_LIMITS,
        security: Security | None = None,
    ) -> None:
        if isinstance(topics, str):
            raise TypeError("Subscriber topics must be a list of topic names, not one string")
        self._limits = limits
        self._sock = make_socket(ctx, zmq.SUB, security=security, server=False, max_frame_bytes=limits.max_frame_bytes)
        self._all = "" in topics
        self._topics = {_check_topic(topic, "Subscriber") for topic in topics}
        for topic in self._topics:
            self._sock.setsockopt(zmq.SUBSCRIBE, topic)
        self._seen: dict[tuple[bytes, bytes], int] = {}
        self._drops = DropLog(log, f"subscriber {endpoint}")
        self.dropped = self._drops.counts
        self.duplicates = 0
        self.endpoints: list[str] = []
        self.connect(endpoint)

    def connect(self, endpoint: str) -> None:
        """Also receive from the publisher at ``endpoint``."""
        try:
            self._sock.connect(endpoint)
        except zmq.ZMQError as exc:
            raise ValueError(f"cannot connect subscriber to {endpoint!r}: {exc}") from exc
        self.endpoints.append(endpoint)

    def reconnect(self, endpoint: str) -> None:
        """Receive from the publisher at ``endpoint`` instead of the ones before (a restarted publisher)."""
        for old in self.endpoints:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disconnect(old)
        self.endpoints = []
        self.connect(endpoint)

    async def recv(self) -> tuple[str, Message]:
        """The next message not seen before on a subscribed topic."""
        skipped = 0
        while True:
            skipped += 1
            if skipped % YIELD_EVERY == 0:
                await asyncio.sleep(0)  # a run of duplicates or garbage must not starve the rest of the actor
            frames = await self._sock.recv_multipart(copy=False)
            if len(frames) != 3 or len(frames[1].bytes) != STAMP_BYTES:
                self._drops(
                    "bad_envelope", f"expected [topic, 16-byte stamp, message], got {len(frames)} frames", "publisher"
                )
                continue
            name = frames[0].bytes
            if not self._all and name not in self._topics:
                continue  # a longer topic that shares a subscribed prefix
            stamp = frames[1].bytes
            key, seq = (name, stamp[:8]), int.from_bytes(stamp[8:], "big")
            if seq <= self._seen.get(key, 0):
                self.duplicates += 1
                continue
            self._seen[key] = seq
            try:
                message = decode(frames[2], self._limits)
            except DecodeError as exc:
                self._drops(exc.reason, f"topic {name!r}: {exc}", "publisher")
                continue
            return name.decode("utf-8", "replace"), message

    def close(self) -> None:
        """Close the socket; a ``recv()`` waiting at that moment raises ``asyncio.CancelledError``."""
        self._sock.close(linger=0)
