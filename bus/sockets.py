"""Socket plumbing shared by the channels: creation, non-blocking sends, and drop accounting."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import zmq
import zmq.asyncio

from bus.security import Security

# Log the first few drops of each reason, then one in every LOG_EVERY, so a flood of garbage cannot flood
# the log; the counters always hold the exact numbers.
LOG_FIRST = 5
LOG_EVERY = 1000


def make_socket(
    ctx: zmq.asyncio.Context,
    kind: int,
    *,
    security: Security | None,
    server: bool,
    max_frame_bytes: int | None = None,
) -> zmq.asyncio.Socket:
    """A socket with linger 0 (close never hangs on a dead peer) and optional CURVE and size limit."""
    if not isinstance(ctx, zmq.asyncio.Context):
        raise TypeError(f"bus channels need a zmq.asyncio.Context, got {type(ctx).__name__}")
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if max_frame_bytes is not None:
        # libzmq refuses larger frames (and drops the connection that sent one) before allocating them.
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    if security is not None:
        if server:
            security.apply_server(sock)
        else:
            security.apply_client(sock)
    return sock


def routing_id(name: str, what: str) -> bytes:
    """A zmq routing id for ``name``: 1..255 bytes, not starting with NUL (reserved by libzmq)."""
    encoded = name.encode("utf-8")
    if not 1 <= len(encoded) <= 255 or encoded[:1] == b"\0":
        raise ValueError(f"{what} {name!r} must be 1..255 UTF-8 bytes and must not start with NUL")
    return encoded


def try_send(sock: zmq.asyncio.Socket, frames: list[Any]) -> bool:
    """Send without waiting; False if the peer is unreachable or its queue is full."""
    future = sock.send_multipart(frames, flags=zmq.DONTWAIT)
    if not future.done():  # queued behind an awaited send on the same socket; it completes (or fails) later
        future.add_done_callback(lambda done: done.cancelled() or done.exception())
        return True
    return future.exception() is None  # also marks a failure as retrieved


class DropLog:
    """Counts dropped frames by reason (``counts`` is the public ``dropped`` Counter) and logs a sample."""

    def __init__(self, logger: logging.Logger, where: str) -> None:
        self.counts: Counter[str] = Counter()
        self._logger = logger
        self._where = where

    def __call__(self, reason: str, detail: str) -> None:
        self.counts[reason] += 1
        n = self.counts[reason]
        if n <= LOG_FIRST or n % LOG_EVERY == 0:
            self._logger.warning("%s: dropped frame (%s, %d so far): %s", self._where, reason, n, detail)
