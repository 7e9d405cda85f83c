"""Stream channel: many producers push messages to a consumer, paced by credits the consumer hands out.

Protocol (every zmq message is one msgpack frame; docs/wire-protocol.md, section 4, is the reference):

1. The sender connects a DEALER (routing id = its sender id) to the receiver's ROUTER and sends
   ``StreamHello(sender_id, session)``; ``session`` is fresh for every connection.
2. The receiver answers ``StreamCredit(limit, window, incarnation, session)``: the sender may have sent
   ``limit`` data frames *in total* during ``session``. The first limit is ``window``.
3. Every other frame the sender sends is data. A message counts as consumed when the application asks
   ``StreamReceiver.recv()`` for the next one; once ``consumed`` is ``window // 4`` ahead of the last grant
   the receiver sends ``limit = consumed + window``.

So at most ``window`` messages per sender exist anywhere between the producer's ``send`` and the consumer's
application (socket buffers, kernel, the wire, the message being processed), and a slow consumer blocks its
producers instead of growing a queue. Limits are cumulative, not increments, so a lost or repeated credit
is harmless and a repeated hello is idempotent: a starved sender re-sends its hello (0.5 s, doubling to
5 s) and gets the current limit back. A receiver restart shows up as a new ``incarnation`` (the sender
drops its count and starts over from the new grant); a receiver that gets data from a sender it has no
session for delivers it (up to two windows' worth) and answers with an empty-session credit, and the sender
starts a new session.
Frames sent while a receiver is down wait in the sender's socket and reach the next incarnation; frames
inside the dead receiver are lost (the lease layer above re-issues that work). When a sender restarts or
reconnects, frames its previous session left in the receiver's queue are still delivered, so the window can
be exceeded once, by at most one window.

Hostile senders: a data frame more than a window past what its session was granted is dropped and counted
as ``over_credit``. Grants follow consumption, so a sender that said hello and then ignores its credits gets
nothing a well-behaved one would not (its queue here is capped at ``RCVHWM = window + 8`` frames of at most
``max_frame_bytes``); one that never says hello is granted one window and gets two windows' worth through
before its frames are dropped. A sender that does not read its credits is counted as ``credit_unread``; a
StreamCredit sent to a receiver is ``unexpected``. Drops are counted per sender
(``dropped_by_peer()``), and the table of accounts is bounded (``MAX_SENDER_ACCOUNTS``, least recently granted
forgotten first).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections import OrderedDict
from dataclasses import dataclass

import zmq
import zmq.asyncio

from bus.address import bind as bind_socket
from bus.codec import DEFAULT_LIMITS, DecodeError, DecodeLimits, decode, decoder_for, encode, encode_into
from bus.faults import sync_view
from bus.schema import Message, StreamCredit, StreamHello
from bus.security import Security
from bus.sockets import YIELD_EVERY, DropLog, make_socket, peer_name, routing_id

log = logging.getLogger(__name__)

HELLO_INTERVAL = 0.5
MAX_HELLO_INTERVAL = 5.0
MAX_SENDER_ACCOUNTS = 4096
CREDIT_FRAME_LIMIT = 64 * 1024  # credits are tiny; a sender refuses anything bigger from its receiver


@dataclass
class _Account:
    """The receiver's view of one sender connection.

    ``received`` counts the data frames that arrived in this session and ``granted`` is the limit last granted;
    a session-less account (data from a sender that never said hello to us) is granted one window, which is
    what a sender's credit left over from our previous incarnation can carry (plus the window of slack every
    account has).
    """

    name: str
    session: str | None
    consumed: int = 0
    granted: int = 0
    received: int = 0


class StreamReceiver:
    """Binds a ROUTER and yields ``(sender_id, message)``, granting each sender ``window`` frames of credit."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        bind: str,
        *,
        window: int = 16,
        limits: DecodeLimits = DEFAULT_LIMITS,
        security: Security | None = None,
    ) -> None:
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"StreamReceiver window must be a positive int, got {window!r}")
        self.window = window
        self.incarnation = secrets.token_hex(8)
        self.received = 0
        self._decoder = decoder_for(limits)
        self._credit_every = max(1, window // 4)
        self._accounts: OrderedDict[bytes, _Account] = OrderedDict()
        self._sock = make_socket(
            ctx, zmq.ROUTER, security=security, server=True, max_frame_bytes=limits.max_frame_bytes
        )
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # credits to a vanished sender fail fast, not silently
        self._sock.setsockopt(zmq.RCVHWM, window + 8)  # per sender; only a credit-ignoring sender hits it
        self.endpoint = bind_socket(self._sock, bind)
        # Fast path: a non-blocking recv on a plain (synchronous) view of the same socket costs a fifth of an
        # asyncio recv; the lock keeps every socket operation inside recv(), so no asyncio future is ever
        # waiting on the socket while the synchronous view touches it (which could swallow its wake-up).
        self._sync = sync_view(self._sock)
        self._lock = asyncio.Lock()
        self._handed_out: bytes | None = None
        self._unsuspended = 0  # frames taken since the last time recv() let other tasks run
        self._drops = DropLog(log, f"stream receiver {self.endpoint}")
        self.dropped = self._drops.counts

    def dropped_by_peer(self) -> dict[str, dict[str, int]]:
        """Drops per sender label and reason (bounded; see ``bus.sockets.DropLog``)."""
        return self._drops.peers()

    def drop_metrics(self, channel: str) -> dict[str, float]:
        """Drop counters for a heartbeat, under ``channel`` (see ``DropLog.metrics``)."""
        return self._drops.metrics(channel)

    async def recv(self) -> tuple[str, Message]:
        """The next data message and the id of the sender; malformed frames are counted and skipped.

        Safe to call from several tasks (they take turns).
        """
        async with self._lock:
            return await self._recv_locked()

    async def _recv_locked(self) -> tuple[str, Message]:
        if self._handed_out is not None:
            # The application is done with the previous message: only now does its credit go back, so the
            # message being processed counts against the window, and the credit's send (which wakes libzmq's
            # I/O thread) never sits between a message's arrival and the application.
            self._consumed(self._handed_out)
            self._handed_out = None
        sync = self._sync
        while True:
            self._unsuspended += 1
            if self._unsuspended >= YIELD_EVERY:
                self._unsuspended = 0
                await asyncio.sleep(0)
            # Ask before receiving: a failed non-blocking recv costs a Python exception, far more than this.
            if sync.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                frames = sync.recv_multipart(zmq.NOBLOCK, copy=False)
            else:
                frames = await self._sock.recv_multipart(copy=False)
                self._unsuspended = 0
            ident = frames[0].bytes
            if len(frames) != 2:
                self._drops("bad_envelope", f"expected [sender, message], got {len(frames)} frames", ident)
                self._consumed(ident)
                continue
            try:
                message = self._decoder.decode(frames[1])
            except DecodeError as exc:
                self._drops(exc.reason, str(exc), ident)
                self._consumed(ident)  # it cost the sender a credit; give it back
                continue
            if type(message) is StreamHello:
                self._hello(ident, message)
                continue
            if type(message) is StreamCredit:
                self._drops("unexpected", "StreamCredit sent to a receiver", ident)
                continue
            account = self._accounts.get(ident) or self._consumed(ident)
            if account.received >= account.granted + self.window:
                # More than a window past its credit: the sender ignores credits (a legitimate one never passes
                # its limit; the window of slack absorbs repeated frames, which a real socket never makes).
                self._drops(
                    "over_credit", f"frame {account.received + 1} of a session granted {account.granted}", ident
                )
                continue
            account.received += 1
            if account.session is not None:
                self._handed_out = ident
            self.received += 1
            return account.name, message

    def _hello(self, ident: bytes, hello: StreamHello) -> None:
        account = self._accounts.get(ident)
        if account is None or account.session != hello.session:
            account = self._new_account(ident, hello.session)
        self._grant(ident, account)  # always answer: a repeated hello just learns the current limit

    def _new_account(self, ident: bytes, session: str | None) -> _Account:
        account = _Account(name=peer_name(ident), session=session)
        self._accounts[ident] = account
        self._accounts.move_to_end(ident)
        while len(self._accounts) > MAX_SENDER_ACCOUNTS:
            self._accounts.popitem(last=False)
        return account

    def _consumed(self, ident: bytes) -> _Account:
        account = self._accounts.get(ident)
        if account is None:
            # Data from a sender that never said hello to this incarnation (we restarted): tell it who we are
            # so it says hello now instead of after its starvation timeout.
            account = self._new_account(ident, None)
            account.granted = self.window
            self._send_credit(
                ident, StreamCredit(limit=0, window=self.window, incarnation=self.incarnation, session="")
            )
            return account
        if account.session is None:
            return account
        account.consumed += 1
        if account.consumed + self.window - account.granted >= self._credit_every:
            self._grant(ident, account)
        return account

    def _grant(self, ident: bytes, account: _Account) -> None:
        account.granted = account.consumed + self.window
        self._accounts.move_to_end(ident)  # a sender in use is the last to be forgotten when the table is full
        credit = StreamCredit(
            limit=account.granted, window=self.window, incarnation=self.incarnation, session=account.session or ""
        )
        self._send_credit(ident, credit)

    def _send_credit(self, ident: bytes, credit: StreamCredit) -> None:
        # Failure means the sender is gone or not reading; its next hello asks again. One that does not read
        # its credits (its queue here is full) is counted: it is flooding us with hellos or data.
        try:
            self._sync.send_multipart([ident, encode(credit)], zmq.NOBLOCK)
        except zmq.Again:
            self._drops("credit_unread", "the sender does not read its credits", ident)
        except zmq.ZMQError:
            pass

    def close(self) -> None:
        """Close the socket; a ``recv()`` waiting at that moment raises ``asyncio.CancelledError``."""
        self._sock.close(linger=0)


@dataclass
class _Peer:
    """The sender's view of one receiver."""

    peer_id: str
    endpoint: str
    sock: zmq.asyncio.Socket
    sync: zmq.Socket  # synchronous view of ``sock`` for non-blocking operations
    hello: bytes = b""
    session: str = ""
    incarnation: str | None = None
    sent: int = 0
    limit: int = 0
    task: asyncio.Task | None = None

    @property
    def credits(self) -> int:
        return self.limit - self.sent


class StreamSender:
    """Pushes messages to one or more receivers, never more than their credit allows.

    Every socket operation on the hot path is a non-blocking call on a synchronous view of the socket: the
    message is encoded into a reusable buffer and copied into libzmq, then any credit that arrived meanwhile is
    read. Reading to EAGAIN after each such call is what keeps the background task's asyncio recv (which
    applies credit while nobody is sending) from missing a wake-up. A sender waiting for credit re-sends its
    hello to starved receivers at ``hello_interval``, doubling up to ``max_hello_interval``.
    """

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        *,
        sender_id: str,
        security: Security | None = None,
        hello_interval: float = HELLO_INTERVAL,
        max_hello_interval: float = MAX_HELLO_INTERVAL,
    ) -> None:
        self.sender_id = sender_id
        routing_id(sender_id, "sender_id")  # refuse a bad id now, not at the first connect
        self._ctx = ctx
        self._security = security
        self._hello_interval = hello_interval
        self._max_hello_interval = max_hello_interval
        self._peers: dict[str, _Peer] = {}
        self._credit_event = asyncio.Event()
        self._buffer = bytearray()
        self._drops = DropLog(log, f"stream sender {sender_id}")
        self.dropped = self._drops.counts
        self.sent = 0
        self._closed = False

    @property
    def peers(self) -> list[str]:
        return list(self._peers)

    def credits(self, peer_id: str) -> int:
        """Frames this sender may still send to ``peer_id`` before it must wait."""
        return self._peers[peer_id].credits

    def connect(self, peer_id: str, endpoint: str) -> None:
        """Start streaming to a receiver; replaces an existing connection to ``peer_id``."""
        if self._closed:
            raise RuntimeError(f"stream sender {self.sender_id} is closed")
        if peer_id in self._peers:
            self.disconnect(peer_id)
        sock = make_socket(
            self._ctx, zmq.DEALER, security=self._security, server=False, max_frame_bytes=CREDIT_FRAME_LIMIT
        )
        # A fresh id per connection: the receiver may not have detached this sender's previous one yet.
        sock.setsockopt(zmq.ROUTING_ID, routing_id(self.sender_id, "sender_id"))
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise ValueError(f"cannot connect to stream receiver {peer_id} at {endpoint!r}: {exc}") from exc
        peer = _Peer(peer_id=peer_id, endpoint=endpoint, sock=sock, sync=sync_view(sock))
        self._peers[peer_id] = peer
        self._new_session(peer)  # the hello is queued by libzmq until the connection is up
        self._start_tasks()

    def disconnect(self, peer_id: str) -> None:
        peer = self._peers.pop(peer_id, None)
        if peer is None:
            return
        if peer.task is not None:
            peer.task.cancel()
        peer.sock.close(linger=0)

    async def send(self, message: Message, *, peer: str | None = None, timeout: float | None = None) -> str:
        """Send once a credit is available (from ``peer``, or the peer with most credit); return the peer used.

        Raises ``asyncio.TimeoutError`` if no credit arrives within ``timeout`` seconds and ``KeyError`` if
        ``peer`` is not connected.
        """
        target = self._pick(peer) or await self._await_credit(peer, timeout)
        buffer = self._buffer
        encode_into(message, buffer)
        try:
            target.sync.send(buffer, zmq.NOBLOCK, copy=True)
        except zmq.Again:
            # The socket's queue is full (only a receiver that ignores its own grants gets here): wait, holding
            # a private copy since the shared buffer is reused by the next send.
            target.sent += 1
            try:
                await target.sock.send(bytes(buffer))
            except BaseException:
                target.sent -= 1
                raise
        else:
            target.sent += 1
        self._drain(target)
        self.sent += 1
        return target.peer_id

    async def wait_for_credit(self, peer: str | None = None, timeout: float | None = None) -> str:
        """Wait until a ``send`` to ``peer`` (or to any peer) would not block; return that peer's id."""
        target = self._pick(peer) or await self._await_credit(peer, timeout)
        return target.peer_id

    async def _await_credit(self, peer: str | None, timeout: float | None) -> _Peer:
        """Wait for credit, re-sending hello to starved receivers with backoff."""
        self._start_tasks()
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        interval = self._hello_interval
        while True:
            for candidate in self._peers.values():
                self._drain(candidate)
            target = self._pick(peer)
            if target is not None:
                return target
            self._credit_event.clear()
            wait = interval if deadline is None else min(interval, deadline - loop.time())
            if wait <= 0:
                raise asyncio.TimeoutError(
                    f"{self.sender_id}: no credit from {peer or 'any receiver'} within {timeout}s"
                )
            try:
                await asyncio.wait_for(self._credit_event.wait(), wait)
            except asyncio.TimeoutError:
                for candidate in self._peers.values():
                    if candidate.credits <= 0 and (peer is None or candidate.peer_id == peer):
                        self._say_hello(candidate)  # idempotent: the answer is the current limit
                interval = min(interval * 2, self._max_hello_interval)

    def _pick(self, peer_id: str | None) -> _Peer | None:
        if peer_id is not None:
            try:
                peer = self._peers[peer_id]
            except KeyError:
                raise KeyError(f"stream sender {self.sender_id} is not connected to {peer_id!r}") from None
            return peer if peer.credits > 0 else None
        best, most = None, 0
        for candidate in self._peers.values():
            if candidate.credits > most:
                best, most = candidate, candidate.credits
        return best

    def _say_hello(self, peer: _Peer) -> None:
        with contextlib.suppress(zmq.ZMQError):  # a full queue: the next attempt will do
            peer.sync.send(peer.hello, zmq.NOBLOCK)
        self._drain(peer)

    def _drain(self, peer: _Peer) -> None:
        """Apply every frame the receiver has sent, without waiting (EVENTS first: exceptions are costly)."""
        sync = peer.sync
        try:
            while sync.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self._on_frame(peer, sync.recv(zmq.NOBLOCK, copy=False))
        except zmq.ZMQError:
            return  # closed under us; the caller's next send reports it

    def _start_tasks(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # started by the first send() inside the loop
        for peer in self._peers.values():
            if peer.task is None:
                peer.task = loop.create_task(self._read_credits(peer), name=f"stream-credits-{peer.peer_id}")

    async def _read_credits(self, peer: _Peer) -> None:
        """Apply credit as it arrives, so a waiting send() wakes without polling."""
        while True:
            frame = await peer.sock.recv(copy=False)
            self._on_frame(peer, frame)
            self._drain(peer)

    def _on_frame(self, peer: _Peer, frame: zmq.Frame) -> None:
        try:
            credit = decode(frame)
        except DecodeError as exc:
            self._drops(exc.reason, str(exc), peer.peer_id)
            return
        if type(credit) is not StreamCredit:
            self._drops("unexpected", f"{type(credit).__name__} from a receiver", peer.peer_id)
            return
        if credit.session == "":
            # The receiver has no session for us (it restarted, or forgot us): whatever we counted is void.
            peer.incarnation = credit.incarnation
            self._new_session(peer)
            return
        self._apply_credit(peer, credit)

    def _new_session(self, peer: _Peer) -> None:
        peer.session = secrets.token_hex(8)
        peer.hello = encode(StreamHello(sender_id=self.sender_id, session=peer.session))
        peer.sent = peer.limit = 0
        self._say_hello(peer)

    def _apply_credit(self, peer: _Peer, credit: StreamCredit) -> None:
        if credit.incarnation != peer.incarnation:
            if peer.incarnation is not None:
                log.info("stream sender %s: receiver %s restarted; resetting credit", self.sender_id, peer.peer_id)
            peer.incarnation = credit.incarnation
            peer.sent = 0
            peer.limit = 0
        if credit.session == peer.session and credit.limit > peer.limit:
            peer.limit = credit.limit
            self._credit_event.set()

    def close(self) -> None:
        self._closed = True
        for peer_id in list(self._peers):
            self.disconnect(peer_id)
