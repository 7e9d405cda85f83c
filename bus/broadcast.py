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
from bus.sockets import DropLog, make_socket, try_send

log = logging.getLogger(__name__)

STAMP_BYTES = 16


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
        self._sock = make_socket(ctx, zmq.XPUB, security=security, server=True, max_frame_bytes=64 * 1024)
        self._sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # pass up every subscription, not only a topic's first
        self._sock.setsockopt(zmq.SNDHWM, sndhwm)
        self.endpoint = bind_socket(self._sock, bind)
        self.publisher_id = secrets.token_bytes(8)
        self._last: dict[bytes, list[bytes]] = {}
        self._seq: dict[bytes, int] = {}
        self._watcher: asyncio.Task | None = None
        self.published = 0
        self.replayed = 0
        self._start_watcher()

    def publish(self, topic: str, message: Message) -> None:
        """Send ``message`` to every subscriber of ``topic`` and remember it for later subscribers."""
        if not topic:
            raise ValueError("publish: topic must be a non-empty string")
        name = topic.encode("utf-8")
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
        while True:
            frames = await self._sock.recv_multipart()
            event = frames[0]
            if len(frames) != 1 or event[:1] != b"\x01":
                continue  # unsubscriptions and anything else a subscriber might send
            prefix = event[1:]
            for name, last in list(self._last.items()):
                if name.startswith(prefix):
                    try_send(self._sock, last)
                    self.replayed += 1

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        self._sock.close(linger=0)


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
        self._topics = {topic.encode("utf-8") for topic in topics}
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
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            if len(frames) != 3 or len(frames[1].bytes) != STAMP_BYTES:
                self._drops("bad_envelope", f"expected [topic, 16-byte stamp, message], got {len(frames)} frames")
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
                self._drops(exc.reason, f"topic {name!r}: {exc}")
                continue
            return name.decode("utf-8", "replace"), message

    def close(self) -> None:
        """Close the socket; a ``recv()`` waiting at that moment raises ``asyncio.CancelledError``."""
        self._sock.close(linger=0)
