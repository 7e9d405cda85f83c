"""Waiting in a test for the event it means: a condition polled until it holds, with a deadline that names it."""

from __future__ import annotations

import asyncio
import inspect
import time
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


def until_sync(condition: Callable[[], object], what: str, timeout_s: float = 30.0) -> None:
    """`until` for a test without an event loop (its work runs in a thread or another process)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.005)
