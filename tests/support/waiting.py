"""Waiting in a test for the event it means: a condition polled until it holds, with a deadline that names it."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable


async def until(condition: Callable[[], object], what: str, timeout_s: float = 30.0) -> None:
    """Return once `condition()` is true (a coroutine function is awaited each time); fail naming `what` after
    `timeout_s` (generous: a deadline, not a guess at how fast this machine is)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await _value(condition()):
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.005)


async def _value(result: object) -> object:
    return await result if inspect.isawaitable(result) else result
