"""Socket plumbing shared by the channels: creation, non-blocking sends, and drop accounting."""

from __future__ import annotations

import logging
import re
import secrets
from collections import Counter
from typing import Any

import zmq
import zmq.asyncio

from bus.security import Security

# Log the first few drops of each reason, then one in every LOG_EVERY, so a flood of garbage cannot flood
# the log; the counters always hold the exact numbers.
LOG_FIRST = 5
LOG_EVERY = 1000

# ZMTP heartbeats on binding sockets: a peer whose machine vanished (no FIN ever arrives) is detached within
# IVL + TIMEOUT, so the connection a restarted process makes is never refused for long as a duplicate.
HEARTBEAT_IVL_MS = 2000
HEARTBEAT_TIMEOUT_MS = 6000

# "name#nonce": the nonce is fresh per socket, so a routing id can neither be predicted from an actor's name nor
# collide with the one a previous process of that actor left behind.
NONCE_SEPARATOR = "#"
_NONCE = re.compile(r"#[0-9a-f]{16}\Z")


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
    if server:
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
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
    """A fresh zmq routing id for one connection of ``name``: the name, ``#`` and a random 64-bit nonce.

    Binding sockets never hand a live routing id over to a newer connection (no ``ROUTER_HANDOVER``), so a
    client that presents someone else's id is refused by libzmq, and the nonce means nobody can present it by
    knowing the actor's name: a spoofer cannot cut a real actor off. ``peer_name`` gives the name back.
    """
    encoded = name.encode("utf-8")
    if not 1 <= len(encoded) <= 255 - 17 or encoded[:1] == b"\0":
        raise ValueError(f"{what} {name!r} must be 1..238 UTF-8 bytes and must not start with NUL")
    return encoded + f"{NONCE_SEPARATOR}{secrets.token_hex(8)}".encode()


def peer_name(ident: bytes | str) -> str:
    """The sender's name in a routing id made by ``routing_id`` (a foreign client's plain id is kept whole)."""
    text = ident.decode("utf-8", "replace") if isinstance(ident, bytes) else ident
    return text[: -17] if _NONCE.search(text) else text


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
