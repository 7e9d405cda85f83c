"""Declaring which message type each actor method handles.

Actors mark methods instead of writing receive loops: `@handles(T)` for messages arriving on the actor's
inbound stream, `@serves(T)` for request/reply (the return value is the reply), `@on_broadcast(topic)` for
controller broadcasts, and `@method` for a custom actor's methods that others call by name with keyword arguments
(`ActorCall` on the wire; `actors.runtime.host.call_actor` from a plugin). The base class collects the marks once
per class, so dispatch is a dict lookup on the message's type (or the call's method name) and an unhandled type is
a counted drop, not an exception.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

HandlerKind = Literal["stream", "rpc", "broadcast", "method"]
_MARK = "__slipstream_handler__"


@dataclass(frozen=True)
class HandlerSpec:
    kind: HandlerKind
    keys: tuple[Any, ...]  # message types for stream/rpc, topic names for broadcast, the name a method is called by
    concurrency: int = 1


def _mark(spec: HandlerSpec) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def decorate(method: Callable[..., Any]) -> Callable[..., Any]:
        setattr(method, _MARK, spec)
        return method

    return decorate


def handles(*message_types: type, concurrency: int = 1) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Stream handler `async def h(self, sender: str, message)`. With concurrency > 1 up to that many run at
    once; credits flow back only as handlers finish, so a slow handler still slows the producers."""
    if not message_types:
        raise TypeError("@handles needs at least one message type")
    if concurrency < 1:
        raise ValueError(f"@handles concurrency must be >= 1, got {concurrency}")
    return _mark(HandlerSpec("stream", message_types, concurrency))


def serves(*message_types: type) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Request/reply handler `async def h(self, sender: str, request) -> reply | None`."""
    if not message_types:
        raise TypeError("@serves needs at least one message type")
    return _mark(HandlerSpec("rpc", message_types))


def on_broadcast(*topics: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Broadcast handler `async def h(self, topic: str, message)` for controller topics."""
    if not topics:
        raise TypeError("@on_broadcast needs at least one topic")
    return _mark(HandlerSpec("broadcast", topics))


def method(function: Callable[..., Any]) -> Callable[..., Any]:
    """A method other actors and plugins call by its name: `async def score(self, *, prompt: str) -> dict`, called
    with `await call_actor("judge", "score", prompt=..., timeout=...)`. Its keyword arguments and its return value
    cross the wire as msgpack (str, numbers, bool, None, lists, dicts); what it raises reaches the caller as an
    `ActorCallError` naming the actor and the error. Calls run concurrently, each as its own task."""
    return _mark(HandlerSpec("method", (function.__name__,)))(function)


@dataclass
class HandlerTable:
    """The handlers of one actor class, keyed for dispatch."""

    stream: dict[type, tuple[str, int]]
    rpc: dict[type, str]
    broadcast: dict[str, str]
    methods: dict[str, str] = field(default_factory=dict)  # the name a method is called by -> its attribute


def collect_handlers(cls: type) -> HandlerTable:
    """Walk the MRO so subclasses inherit handlers and may override them by method name."""
    table = HandlerTable(stream={}, rpc={}, broadcast={}, methods={})
    seen: set[str] = set()
    for klass in cls.__mro__:
        for name, member in vars(klass).items():
            if name in seen:
                continue
            spec: HandlerSpec | None = getattr(member, _MARK, None)
            if spec is None:
                continue
            seen.add(name)
            for key in spec.keys:
                if spec.kind == "stream":
                    table.stream.setdefault(key, (name, spec.concurrency))
                elif spec.kind == "rpc":
                    table.rpc.setdefault(key, name)
                elif spec.kind == "method":
                    table.methods.setdefault(key, name)
                else:
                    table.broadcast.setdefault(key, name)
    return table
