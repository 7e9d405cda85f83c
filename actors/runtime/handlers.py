"""Declaring which message type each actor method handles.

Actors mark methods instead of writing receive loops: `@handles(T)` for messages arriving on the actor's
inbound stream, `@serves(T)` for request/reply (the return value is the reply), `@on_broadcast(topic)` for
controller broadcasts. The base class collects the marks once per class, so dispatch is a dict lookup on the
message's type and an unhandled type is a counted drop, not an exception.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

HandlerKind = Literal["stream", "rpc", "broadcast"]
_MARK = "__slipstream_handler__"


@dataclass(frozen=True)
class HandlerSpec:
    kind: HandlerKind
    keys: tuple[Any, ...]  # message types for stream/rpc, topic names for broadcast
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


@dataclass
class HandlerTable:
    """The handlers of one actor class, keyed for dispatch."""

    stream: dict[type, tuple[str, int]]
    rpc: dict[type, str]
    broadcast: dict[str, str]


def collect_handlers(cls: type) -> HandlerTable:
    """Walk the MRO so subclasses inherit handlers and may override them by method name."""
    table = HandlerTable(stream={}, rpc={}, broadcast={})
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
                else:
                    table.broadcast.setdefault(key, name)
    return table
