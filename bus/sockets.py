"""Socket plumbing shared by the channels: creation, non-blocking sends, and drop accounting."""

from __future__ import annotations

import logging
import re
import secrets
from collections import Counter
from typing import Any

import zmq
import zmq.asyncio

from bus import faults
from bus.security import Security

# Log the first few drops of each reason, then one in every LOG_EVERY, so a flood of garbage cannot flood
# the log; the counters always hold the exact numbers.
LOG_FIRST = 5
LOG_EVERY = 1000

# A receive loop that finds frame after frame already queued never suspends, so under a flood it would starve
# every other task of its process (its heartbeats first): it yields to the event loop once every YIELD_EVERY.
YIELD_EVERY = 32

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
    sock = ctx.socket(kind, socket_class=faults.socket_class())  # None: the default; a plan: bus/faults.py
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


# Per-peer drop rows kept by a DropLog; a flood of fresh identities folds into OTHER_PEERS instead of growing it.
MAX_PEER_ROWS = 32
OTHER_PEERS = "(other)"
ANONYMOUS_PEER = "(anonymous)"
MAX_PEER_LABEL = 64
_UNSAFE_LABEL = re.compile(r"[^A-Za-z0-9_.\-#:()@]")


def peer_label(ident: bytes | str) -> str:
    """``peer_name`` made safe for a metric key: letters, digits and ``_.-#:()@``, at most 64 characters.

    A client that set no routing id gets a random 5-byte one from libzmq (first byte NUL); those are all
    ``(anonymous)``, so they cannot each take a row of the drop table.
    """
    if isinstance(ident, bytes) and ident[:1] == b"\0":
        return ANONYMOUS_PEER
    return _UNSAFE_LABEL.sub("_", peer_name(ident))[:MAX_PEER_LABEL] or ANONYMOUS_PEER


class DropLog:
    """Counts dropped frames by reason and by peer, and logs a sample.

    ``counts`` (a channel's public ``dropped``) is the total per reason. ``by_peer`` maps a sender's label
    (``peer_label``) to its Counter of reasons, for at most ``max_peers`` senders: when a new sender's first
    drop finds the table full, the row with the fewest drops is folded into the ``(other)`` row, so the table
    keeps the heaviest offenders exactly and its size is bounded however many identities a flood invents.
    The sum over all rows, ``(other)`` included, always equals ``counts``. Only drops pay for any of this: a
    valid frame never reaches a DropLog.
    """

    def __init__(self, logger: logging.Logger, where: str, *, max_peers: int = MAX_PEER_ROWS) -> None:
        if max_peers < 1:
            raise ValueError(f"DropLog max_peers must be >= 1, got {max_peers}")
        self.counts: Counter[str] = Counter()
        self.by_peer: dict[str, Counter[str]] = {}
        self._totals: dict[str, int] = {}
        self._other: Counter[str] = Counter()
        self._max_peers = max_peers
        self._logger = logger
        self._where = where

    def __call__(self, reason: str, detail: str, peer: bytes | str | None = None) -> None:
        """Count one dropped frame; ``peer`` is the sender's routing id (or a label) when the socket knows it."""
        self.counts[reason] += 1
        label = ANONYMOUS_PEER if peer is None else peer_label(peer)
        row = self.by_peer.get(label)
        if row is None:
            row = self._new_row(label)
        row[reason] += 1
        if row is not self._other:
            self._totals[label] += 1
        n = self.counts[reason]
        if n <= LOG_FIRST or n % LOG_EVERY == 0:
            self._logger.warning(
                "%s: dropped frame (%s, %d so far) from %s: %s", self._where, reason, n, label, detail
            )

    def _new_row(self, label: str) -> Counter[str]:
        if label == OTHER_PEERS:
            return self._other
        if len(self.by_peer) >= self._max_peers:
            lightest = min(self._totals, key=self._totals.__getitem__)
            self._other.update(self.by_peer.pop(lightest))
            del self._totals[lightest]
        row = self.by_peer[label] = Counter()
        self._totals[label] = 0
        return row

    def peers(self) -> dict[str, dict[str, int]]:
        """Drops per peer label and reason, the ``(other)`` row included when it has any."""
        table = {label: dict(row) for label, row in self.by_peer.items()}
        if self._other:
            table[OTHER_PEERS] = dict(self._other)
        return table

    def metrics(self, channel: str) -> dict[str, float]:
        """Heartbeat counters: ``dropped.{channel}.{reason}`` and ``dropped_by.{channel}.{peer}.{reason}``.

        Channels and reasons hold no dot, so a key splits back into its parts even when the peer label has some.
        """
        found = {f"dropped.{channel}.{reason}": float(count) for reason, count in self.counts.items()}
        for label, row in self.peers().items():
            for reason, count in row.items():
                found[f"dropped_by.{channel}.{label}.{reason}"] = float(count)
        return found
