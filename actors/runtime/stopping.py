"""Racing work against a stop request: nothing an actor awaits may outlast a SIGTERM it was sent."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


class StoppedWhileStarting(Exception):
    """A stop was asked for before the actor's start-up finished; the start-up was given up."""


async def unless_stopped(awaitable: Awaitable[T], stopped: asyncio.Event) -> tuple[bool, T | None]:
    """(True, its result) when `awaitable` ends first (its exception, raised); (False, None) once `stopped` is
    set, the awaitable then cancelled and its cancellation awaited. What it started in a thread runs on."""
    task = asyncio.ensure_future(awaitable)
    stop = asyncio.ensure_future(stopped.wait())
    await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    stop.cancel()
    if task.done():
        return True, task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return False, None
