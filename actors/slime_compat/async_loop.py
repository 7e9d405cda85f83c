"""slime's ``run(coro)``: run a coroutine on one background event loop from synchronous code.

A ported slime rollout function is synchronous and drives its requests with ``run(...)``; its
``from slime.utils.async_utils import run`` imports this one (`actors.slime_compat.imports`). One loop for the process
(not ``asyncio.run`` per call) keeps one HTTP session (`actors.slime_compat.http`) alive across rollouts instead of
leaving one behind per call.
"""

from __future__ import annotations

import asyncio
import atexit
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["run"]

T = TypeVar("T")
_loop: asyncio.AbstractEventLoop | None = None
_lock = threading.Lock()


def _background_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="slime-compat-loop", daemon=True).start()
            atexit.register(_close, _loop)
        return _loop


def _close(loop: asyncio.AbstractEventLoop) -> None:
    """At exit: close the loop's HTTP session while the loop still runs (a second at most)."""
    from actors.slime_compat.http import close_session

    try:
        asyncio.run_coroutine_threadsafe(close_session(), loop).result(1.0)
    except Exception:  # exiting anyway; the OS reclaims the sockets
        return


def run(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """The coroutine's result, computed on the background loop; ``timeout`` seconds at most when given."""
    return asyncio.run_coroutine_threadsafe(coro, _background_loop()).result(timeout)
