"""Connections to other actors that follow the roster.

Actors name peers by role, never by address: a rollout worker streams to "reward", asks "buffer" for leases.
When a peer dies and comes back on a new port, the next roster carries its new endpoint and these objects
reconnect, so no actor code handles restarts of its neighbours.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from typing import Any

import zmq.asyncio

from actors.runtime.waits import Waits
from bus import RpcClient, RpcClosed, RpcTimeout, StreamSender
from bus.schema import ActorCall, ActorReply, Error, Member


def alive_members(roster: dict[str, Member], role: str, policy: str | None = None) -> list[Member]:
    """The live members of `role`; with `policy`, only that policy's (a run of several has a buffer each)."""
    found = [m for m in roster.values() if m.role == role and m.alive and (policy is None or m.policy == policy)]
    return sorted(found, key=lambda m: m.actor_id)


def engine_members(roster: dict[str, Member], owner: str | None) -> list[Member]:
    """The live rollout workers whose engines are `owner`'s: a policy's own (its `own_engines`), or the run's shared
    ones (None), which every other policy's adapter is served on."""
    return [member for member in alive_members(roster, "rollout") if member.policy == owner]


class _RoleLink:
    """What a link to a role knows: the role (and the policy, where its members are one policy's), which of its
    members' endpoints it connects to, and where it reports what it waits for (the hang detector's `Waits`)."""

    def __init__(self, role: str, endpoint_name: str, waits: Waits | None, policy: str | None = None) -> None:
        self.role = role
        self.endpoint_name = endpoint_name
        self.policy = policy
        self._waits = waits

    def _endpoints(self, roster: dict[str, Member]) -> dict[str, str]:
        """Actor id -> endpoint of every live member of the role that offers the endpoint, ordered by actor id."""
        return {m.actor_id: m.endpoints[self.endpoint_name] for m in alive_members(roster, self.role, self.policy)
                if self.endpoint_name in m.endpoints}


class PeerStream(_RoleLink):
    """A stream to every live member of one role, load-balanced by the credits each receiver grants."""

    def __init__(self, zmq_context: zmq.asyncio.Context, *, sender_id: str, role: str, endpoint_name: str,
                 security: Any = None, waits: Waits | None = None, policy: str | None = None) -> None:
        super().__init__(role, endpoint_name, waits, policy)
        self._sender = StreamSender(zmq_context, sender_id=sender_id, security=security)
        self._connected: dict[str, str] = {}  # actor id -> endpoint
        self._changed = asyncio.Event()

    def sync(self, roster: dict[str, Member]) -> None:
        wanted = self._endpoints(roster)
        for actor_id, endpoint in list(self._connected.items()):
            if wanted.get(actor_id) != endpoint:
                self._sender.disconnect(actor_id)
                del self._connected[actor_id]
        for actor_id, endpoint in wanted.items():
            if actor_id not in self._connected:
                self._sender.connect(actor_id, endpoint)
                self._connected[actor_id] = endpoint
        self._changed.set()

    @property
    def peers(self) -> list[str]:
        return sorted(self._connected)

    async def send(self, message: Any, *, peer: str | None = None, timeout: float | None = None) -> str:
        """Send to `peer`, or to whichever live member has credit; waits while the role has no members. The wait is
        open to the hang detector: with no timeout, a receiver that never grants credit shows up by name there."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        with _waiting(self._waits, peer or self.role, f"room to send {type(message).__name__} (stream credit)"):
            while not self._connected:
                self._changed.clear()
                remaining = None if deadline is None else max(0.0, deadline - loop.time())
                await asyncio.wait_for(self._changed.wait(), remaining)
            remaining = None if deadline is None else max(0.0, deadline - loop.time())
            return await self._sender.send(message, peer=peer, timeout=remaining)

    def close(self) -> None:
        self._sender.close()


class _RpcLink(_RoleLink):
    """A link that opens request/reply clients to members of its role, as `client_id`."""

    def __init__(self, zmq_context: zmq.asyncio.Context, *, client_id: str, role: str, endpoint_name: str,
                 security: Any = None, waits: Waits | None = None, policy: str | None = None) -> None:
        super().__init__(role, endpoint_name, waits, policy)
        self._zmq = zmq_context
        self._client_id = client_id
        self._security = security

    def _open(self, endpoint: str) -> RpcClient:
        return RpcClient(self._zmq, endpoint, client_id=self._client_id, security=self._security)


class PeerRpc(_RpcLink):
    """A request/reply client to the single live member of a role (the buffer, the controller's delegate)."""

    def __init__(self, zmq_context: zmq.asyncio.Context, **link: Any) -> None:
        super().__init__(zmq_context, **link)
        self._client: RpcClient | None = None
        self._endpoint: str | None = None
        self._available = asyncio.Event()

    def sync(self, roster: dict[str, Member]) -> None:
        endpoint = next(iter(self._endpoints(roster).values()), None)  # the first by actor id
        if endpoint == self._endpoint:
            return
        if self._client is not None:
            self._client.close()
            self._client = None
        self._endpoint = endpoint
        if endpoint is None:
            self._available.clear()
            return
        self._client = self._open(endpoint)
        self._available.set()

    async def call(self, message: Any, *, timeout: float = 5.0, retries: int = 3,
                   member_wait: float | None = None) -> Any:
        """Call the role's member; waits up to `member_wait` (default: `timeout`, one attempt's) for one to exist
        first. A call cut short because the member moved (restart, new endpoint) is sent again to where it is now."""
        with _waiting(self._waits, self.role, f"the reply to {type(message).__name__}"):
            for attempt in range(3):
                client = await self._member(timeout if member_wait is None else member_wait)
                try:
                    return await client.call(message, timeout=timeout, retries=retries)
                except RpcClosed:
                    if attempt == 2:
                        raise
        raise AssertionError("unreachable")

    async def _member(self, timeout: float) -> RpcClient:
        """The member's client, waiting up to `timeout` for one. A member that appeared and went again before this
        task ran (a roster that said it died) leaves none: wait again, within the same deadline."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._client is None:
            await asyncio.wait_for(self._available.wait(), max(0.0, deadline - loop.time()))
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        self._available.clear()


class ActorCallError(RuntimeError):
    """A call to a custom actor's method that brought no result: no member of the role to call within the deadline,
    none answering within it, or the method raised. The message names the role, the member and the method."""


class PeerCalls(_RpcLink):
    """Calls by name to the `@method`s of every live member of one role, spread over them: each call goes to the
    member with the fewest of this link's calls in flight, ties in turn, so every reward worker keeps every judge
    busy. The roster keeps the members current: a member that died drops out, one restarted on a new endpoint is
    called there, and a call cut short by such a move goes to a member that is there, within the same deadline."""

    def __init__(self, zmq_context: zmq.asyncio.Context, **link: Any) -> None:
        super().__init__(zmq_context, **link)
        self._clients: dict[str, RpcClient] = {}  # actor id -> a client of its endpoint
        self._in_flight: Counter[str] = Counter()
        self._turn = 0
        self._changed = asyncio.Event()

    def sync(self, roster: dict[str, Member]) -> None:
        wanted = self._endpoints(roster)
        for actor_id, client in list(self._clients.items()):
            if wanted.get(actor_id) != client.endpoint:
                client.close()  # a call waiting on it raises RpcClosed, and goes elsewhere
                del self._clients[actor_id]
        for actor_id, endpoint in wanted.items():
            if actor_id not in self._clients:
                self._clients[actor_id] = self._open(endpoint)
        self._changed.set()

    @property
    def peers(self) -> list[str]:
        return sorted(self._clients)

    async def call(self, method: str, args: dict[str, Any], *, timeout: float) -> Any:
        """What `method` of one member returned; raises ActorCallError when `timeout` seconds bring no result."""
        if timeout <= 0:
            raise ValueError(f"call of {self.role}.{method}: timeout must be > 0 seconds, got {timeout}")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        request = ActorCall(method=method, args=args)
        with _waiting(self._waits, self.role, f"the reply to {method}"):
            while True:
                actor_id = await self._member(deadline, f"to call {method} within {timeout:g} s")
                self._in_flight[actor_id] += 1
                try:
                    reply = await self._clients[actor_id].call(request, timeout=max(deadline - loop.time(), 1e-3),
                                                             retries=0)
                except RpcClosed:  # it left or moved while we waited: the roster has its successor, or another
                    if loop.time() < deadline:
                        continue
                    raise ActorCallError(f"{actor_id} left before it answered {method}, and {timeout:g} s are up") \
                        from None
                except RpcTimeout:
                    raise ActorCallError(f"{actor_id} did not answer {method} within {timeout:g} s") from None
                finally:
                    self._in_flight[actor_id] -= 1
                if isinstance(reply, Error):
                    raise ActorCallError(f"{actor_id}: {method} failed: {reply.detail or reply.reason}")
                if not isinstance(reply, ActorReply):
                    raise ActorCallError(f"{actor_id} answered {method} with {type(reply).__name__}, not ActorReply")
                return reply.result

    async def _member(self, deadline: float, purpose: str) -> str:
        """The live member to call next: the one with the fewest of our calls in flight, ties taken in turn; waits
        for the roster to bring one until `deadline`."""
        loop = asyncio.get_running_loop()
        while not self._clients:
            self._changed.clear()
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise ActorCallError(f"no live {self.role!r} actor {purpose} (is one started, with --custom-actor "
                                     f"{self.role}=MODULE:CLASS, and not crashing?)")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
        members = sorted(self._clients)
        fewest = min(self._in_flight[member] for member in members)
        idle = [member for member in members if self._in_flight[member] == fewest]
        self._turn += 1
        return idle[self._turn % len(idle)]

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()


def _waiting(waits: Waits | None, on: str, what: str) -> contextlib.AbstractContextManager[None]:
    return waits.on(on, what) if waits is not None else contextlib.nullcontext()
