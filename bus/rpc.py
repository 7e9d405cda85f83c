"""Request/reply channel: DEALER clients, a ROUTER server, request ids, timeouts, retries, idempotent replies.

Envelope (see docs/wire-protocol.md, "RPC"): the client sends ``[request_id, message]``; the server answers
``[request_id, reply]`` to the same client. ``request_id`` is opaque (1..64 bytes), unique per call, and
reused by every retry of that call. The server remembers recent replies by (client, request_id): a retry
that arrives after the handler finished is answered from that cache, one that arrives while the handler is
still running is ignored (the reply is on its way), so a handler runs once per call however often the
client retries. That is what lets a learner safely retry ``BatchRequest`` without training a batch twice.

Hostile clients: requests are small, so the server refuses frames over ``REQUEST_LIMITS.max_frame_bytes``
(libzmq drops them, and the connection, before allocating) and queues at most ``MAX_QUEUED_PER_CLIENT``
requests per connection; a malformed request is answered with an ``Error`` naming its reason and counted per
client (``dropped_by_peer()``), but not cached, so garbage cannot push real replies out of the cache.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio

from bus.address import bind as bind_socket
from bus.codec import DEFAULT_LIMITS, DecodeError, DecodeLimits, decode, encode
from bus.schema import Ack, Error, Message
from bus.security import Security
from bus.sockets import YIELD_EVERY, DropLog, make_socket, routing_id, try_send

log = logging.getLogger(__name__)

Handler = Callable[[str, Message], Awaitable[Message | None]]

MAX_REQUEST_ID_BYTES = 64
MAX_QUEUED_PER_CLIENT = 32  # requests waiting in libzmq per client connection (RCVHWM); a client has a few
REQUEST_LIMITS = DecodeLimits(max_frame_bytes=16 << 20)  # requests are small; replies (a Batch) may be large
PROBE_REQUEST_ID = b"probe"
_PROBE = encode(Ack(ok=True))


class RpcTimeout(asyncio.TimeoutError):
    """No reply after every attempt; names the endpoint, the request and the attempts made."""

    def __init__(self, endpoint: str, request: str, attempts: int, timeout: float) -> None:
        super().__init__(f"RPC {request} to {endpoint}: no reply after {attempts} attempt(s) of {timeout:g}s each")
        self.endpoint = endpoint
        self.attempts = attempts


class RpcClosed(ConnectionError):
    """The client was closed while this call waited (e.g. the server moved and the caller reconnected).

    Distinct from cancellation on purpose: a caller's task that sees CancelledError would believe it was itself
    cancelled and stop; a closed client is an ordinary, retryable failure of this one call.
    """


class _ReplyCache:
    """Recent replies by (client, request id), bounded in entries, bytes and age."""

    def __init__(self, ttl: float, max_entries: int, max_bytes: int) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[bytes, bytes], tuple[float, bytes]] = OrderedDict()
        self._bytes = 0

    def get(self, key: tuple[bytes, bytes]) -> bytes | None:
        self._expire()
        entry = self._entries.get(key)
        return entry[1] if entry else None

    def put(self, key: tuple[bytes, bytes], reply: bytes) -> None:
        if len(reply) > self.max_bytes:
            return
        self._entries[key] = (time.monotonic() + self.ttl, reply)
        self._bytes += len(reply)
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            self._pop_oldest()

    def _expire(self) -> None:
        now = time.monotonic()
        while self._entries and next(iter(self._entries.values()))[0] < now:
            self._pop_oldest()

    def _pop_oldest(self) -> None:
        _, (_, reply) = self._entries.popitem(last=False)
        self._bytes -= len(reply)


class RpcServer:
    """Binds a ROUTER and answers each request with the handler's reply, one task per request."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        bind: str,
        *,
        limits: DecodeLimits = REQUEST_LIMITS,
        security: Security | None = None,
        max_concurrency: int = 64,
        reply_cache_ttl: float = 60.0,
        reply_cache_entries: int = 4096,
        reply_cache_bytes: int = 256 << 20,
    ) -> None:
        if max_concurrency < 1:
            raise ValueError(f"RpcServer max_concurrency must be >= 1, got {max_concurrency}")
        self._limits = limits
        self._max_concurrency = max_concurrency
        self._sock = make_socket(
            ctx, zmq.ROUTER, security=security, server=True, max_frame_bytes=limits.max_frame_bytes
        )
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.RCVHWM, MAX_QUEUED_PER_CLIENT)
        self.endpoint = bind_socket(self._sock, bind)
        self._cache = _ReplyCache(reply_cache_ttl, reply_cache_entries, reply_cache_bytes)
        self._in_flight: set[tuple[bytes, bytes]] = set()
        self._tasks: set[asyncio.Task] = set()
        self._drops = DropLog(log, f"rpc server {self.endpoint}")
        self.dropped = self._drops.counts
        self.handled = 0
        self.duplicates = 0
        self._closed = False

    def dropped_by_peer(self) -> dict[str, dict[str, int]]:
        """Drops per client label and reason (bounded; see ``bus.sockets.DropLog``)."""
        return self._drops.peers()

    def drop_metrics(self, channel: str) -> dict[str, float]:
        """Drop counters for a heartbeat under ``channel``, and the retries answered without the handler."""
        return {**self._drops.metrics(channel), f"duplicates.{channel}": float(self.duplicates)}

    async def serve(self, handler: Handler) -> None:
        """Answer requests until ``close()``; at most ``max_concurrency`` handlers run at once."""
        slots = asyncio.Semaphore(self._max_concurrency)
        taken = 0
        try:
            while not self._closed:
                await slots.acquire()  # when all slots are busy, requests wait in zmq (bounded by its HWM)
                try:
                    frames = await self._sock.recv_multipart(copy=False)
                except BaseException:
                    slots.release()
                    raise
                started = self._dispatch(frames, handler, slots)
                if not started:
                    slots.release()
                taken += 1
                if taken % YIELD_EVERY == 0:
                    # A queued frame is received without suspending: let handlers and the rest of the process run.
                    await asyncio.sleep(0)
        except (asyncio.CancelledError, zmq.ZMQError):
            if not self._closed:
                raise

    def _dispatch(self, frames: list[zmq.Frame], handler: Handler, slots: asyncio.Semaphore) -> bool:
        client = frames[0].bytes
        if len(frames) != 3:
            self._drops("bad_envelope", f"expected [request_id, message], got {len(frames) - 1} frames", client)
            return False
        request_id = frames[1].bytes
        if not 1 <= len(request_id) <= MAX_REQUEST_ID_BYTES:
            self._drops("bad_envelope", f"request id of {len(request_id)} bytes", client)
            return False
        key = (client, request_id)
        cached = self._cache.get(key)
        if cached is not None:
            self.duplicates += 1
            try_send(self._sock, [client, request_id, cached])
            return False
        if key in self._in_flight:
            self.duplicates += 1
            return False
        try:
            request = decode(frames[2], self._limits)
        except DecodeError as exc:
            self._drops(exc.reason, str(exc), client)
            # Not cached: a retry is just as malformed, and garbage must not evict the replies real calls need.
            self._reply(key, Error(reason=exc.reason, detail=str(exc)), cache=False)
            return False
        self._in_flight.add(key)
        task = asyncio.get_running_loop().create_task(self._handle(handler, key, request, slots))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def _handle(
        self, handler: Handler, key: tuple[bytes, bytes], request: Message, slots: asyncio.Semaphore
    ) -> None:
        try:
            try:
                reply = await handler(key[0].decode("utf-8", "replace"), request)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.exception("rpc server %s: handler failed on %s", self.endpoint, type(request).__name__)
                reply = Error(reason="handler_error", detail=f"{type(exc).__name__}: {exc}")
            self.handled += 1
            self._reply(key, Ack(ok=True) if reply is None else reply)
        finally:
            self._in_flight.discard(key)
            slots.release()

    def _reply(self, key: tuple[bytes, bytes], reply: Message, *, cache: bool = True) -> None:
        try:
            frame = encode(reply)
        except (TypeError, ValueError) as exc:
            log.error("rpc server %s: cannot encode %s reply: %s", self.endpoint, type(reply).__name__, exc)
            frame = encode(Error(reason="encode_error", detail=f"{type(reply).__name__}: {exc}"))
        if cache:
            self._cache.put(key, frame)
        if not self._closed:
            try_send(self._sock, [key[0], key[1], frame])  # a vanished client will retry or has given up

    def reaches(self, client: str) -> bool:
        """Whether a connection with routing id ``client`` (a handler's ``sender``) is attached right now.

        Asked by sending it a reply to a request it never made, which a client counts as a late reply: with
        ROUTER_MANDATORY only an attached connection accepts it. A full queue still counts as attached.
        """
        future = self._sock.send_multipart([client.encode("utf-8"), PROBE_REQUEST_ID, _PROBE], flags=zmq.DONTWAIT)
        if not future.done():
            return True
        error = future.exception()
        return not (isinstance(error, zmq.ZMQError) and error.errno == zmq.EHOSTUNREACH)

    def close(self) -> None:
        """Stop: ``serve()`` returns, running handlers are cancelled and their replies never sent."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        self._sock.close(linger=0)


class RpcClient:
    """A DEALER to one server; ``call`` may be used by many tasks at once (replies matched by request id)."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        *,
        client_id: str,
        security: Security | None = None,
        limits: DecodeLimits = DEFAULT_LIMITS,
    ) -> None:
        self.endpoint = endpoint
        self.client_id = client_id
        self._limits = limits
        self._sock = make_socket(
            ctx, zmq.DEALER, security=security, server=False, max_frame_bytes=limits.max_frame_bytes
        )
        self._sock.setsockopt(zmq.ROUTING_ID, routing_id(client_id, "client_id"))
        # Queue nothing while disconnected: a request is (re)sent by the retry loop, never replayed stale by zmq.
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        try:
            self._sock.connect(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            raise ValueError(f"cannot connect RPC client {client_id} to {endpoint!r}: {exc}") from exc
        self._pending: dict[bytes, asyncio.Future[Message]] = {}
        self._reader: asyncio.Task | None = None
        self._drops = DropLog(log, f"rpc client {client_id} -> {endpoint}")
        self.dropped = self._drops.counts
        self.late_replies = 0
        self.retries = 0

    async def call(self, message: Message, *, timeout: float = 5.0, retries: int = 3) -> Message:
        """Send ``message`` and return the reply (an ``Error`` reply is returned, not raised).

        Each attempt waits ``timeout`` seconds; up to ``retries`` more attempts reuse the request id, so the
        server runs the handler once. Raises ``RpcTimeout`` when every attempt timed out, ``DecodeError``
        if the reply was malformed, ``RpcClosed`` if the client was closed meanwhile.
        """
        if timeout <= 0 or retries < 0:
            raise ValueError(f"RpcClient.call: need timeout > 0 and retries >= 0, got {timeout}, {retries}")
        frame = encode(message)
        request_id = uuid.uuid4().bytes
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[Message] = loop.create_future()
        self._pending[request_id] = reply
        self._ensure_reader()
        try:
            for attempt in range(retries + 1):
                if attempt:
                    self.retries += 1
                deadline = loop.time() + timeout
                try:
                    await asyncio.wait_for(self._sock.send_multipart([request_id, frame], copy=False), timeout)
                    return await asyncio.wait_for(asyncio.shield(reply), max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:
                    continue
                except zmq.ZMQError as exc:
                    if self._sock.closed:
                        raise RpcClosed(f"RPC client {self.client_id} to {self.endpoint} was closed") from exc
                    raise
                except asyncio.CancelledError:
                    # pyzmq cancels a pending send when its socket closes; that is a closed client, not a
                    # cancellation of the caller, which must not end the caller's task as if asked to stop.
                    if self._sock.closed and not _being_cancelled():
                        raise RpcClosed(f"RPC client {self.client_id} to {self.endpoint} was closed") from None
                    raise
            raise RpcTimeout(self.endpoint, type(message).__name__, retries + 1, timeout)
        finally:
            self._pending.pop(request_id, None)
            if not reply.done():
                reply.cancel()

    def _ensure_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read_replies(), name=f"rpc-{self.client_id}")

    async def _read_replies(self) -> None:
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            if len(frames) != 2:
                self._drops("bad_envelope", f"expected [request_id, reply], got {len(frames)} frames", "server")
                continue
            future = self._pending.get(frames[0].bytes)
            if future is None or future.done():
                self.late_replies += 1
                continue
            try:
                future.set_result(decode(frames[1], self._limits))
            except DecodeError as exc:
                self._drops(exc.reason, str(exc), "server")
                future.set_exception(exc)

    def close(self) -> None:
        """Close the socket; a ``call()`` waiting at that moment raises ``RpcClosed``."""
        if self._reader is not None:
            self._reader.cancel()
        for future in self._pending.values():
            if not future.done():
                future.set_exception(RpcClosed(f"RPC client {self.client_id} to {self.endpoint} was closed"))
                future.exception()  # retrieved here, so a call already gone does not warn "never retrieved"
        self._sock.close(linger=0)


def _being_cancelled() -> bool:
    """True when someone cancelled the running task (as opposed to a future it awaited being cancelled)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return task is None or cancelling is None or cancelling() > 0
