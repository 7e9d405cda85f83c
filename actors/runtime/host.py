"""The actor a plugin runs in, so that a plugin can call another actor: `await call_actor("judge", "score", ...)`.

A reward function, a generate function or an environment is called by its role with its own arguments, none of
which leads to the rest of the run. Each actor marks itself as the host of what runs under it: a context variable
set when its `main()` starts, which every task it starts inherits, and every worker thread `asyncio.to_thread`
starts (sync reward functions run there). Actors in one test process each see their own. A plugin's calls then go
through its host's links, which follow the roster as the role's own links do.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any, Protocol

from actors.runtime.peers import ActorCallError, PeerCalls

__all__ = ["ActorCallError", "Host", "call_actor", "host_actor"]


class Host(Protocol):
    """What a plugin's calls need of the actor it runs in (`actors.runtime.base.Actor` is one)."""

    def calls(self, role: str) -> PeerCalls: ...


_HOST: ContextVar[Host] = ContextVar("slipstream_host_actor")


def become_host(actor: Host) -> None:
    """Called by the actor as its main() starts: what runs under it from now on runs in it."""
    _HOST.set(actor)


def host_actor() -> Host:
    """The actor this code runs in; an error outside one (a plugin called from a script or a tool)."""
    try:
        return _HOST.get()
    except LookupError:
        raise ActorCallError("call_actor works in the actors a launcher starts (a reward function, a generate "
                             "function, an environment, a custom actor); this code runs outside one") from None


async def call_actor(role: str, method: str, /, *, timeout: float, **args: Any) -> Any:
    """Call `method` of a live `role` actor (a custom actor's `@method`) with keyword `args`, and return what it
    returned. The call goes to the member with the fewest of this actor's calls in flight, and waits up to `timeout`
    seconds in all, for a member to exist (one restarting) and for its answer. Raises ActorCallError, naming the
    role, the member and the method, when that brings no result: none live, no answer in time, or the method
    raised. Call it from async code running in the actor (an `async def` reward function)."""
    return await host_actor().calls(role).call(method, args, timeout=timeout)
