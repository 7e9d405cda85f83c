"""``post``/``get`` with the shape of slime's ``slime.utils.http_utils`` helpers, for generate plugins.

A plugin's ``from slime.utils.http_utils import post`` imports this one (`actors.slime_compat.imports`). One
aiohttp session per event loop; a failed request is retried a few times, then raises with the URL in the message.
aiohttp is imported at the first request: importing it costs 0.11 s, and this package loads in every rollout
worker, plugin or not.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import aiohttp

__all__ = ["close_session", "get", "post"]

_sessions: dict[int, aiohttp.ClientSession] = {}


def _session() -> aiohttp.ClientSession:
    import aiohttp

    loop_id = id(asyncio.get_running_loop())
    session = _sessions.get(loop_id)
    if session is None or session.closed:
        session = _sessions[loop_id] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
    return session


async def close_session() -> None:
    """Close this event loop's session (a loop that ends with an open one leaves "Unclosed client session")."""
    session = _sessions.pop(id(asyncio.get_running_loop()), None)
    if session is not None:
        await session.close()


async def post(url: str, payload: dict[str, Any], max_retries: int = 3, headers: dict[str, str] | None = None) -> Any:
    """POST JSON, return the decoded JSON reply."""
    import aiohttp

    last: Exception | None = None
    for attempt in range(max(1, max_retries)):
        try:
            async with _session().post(url, json=payload, headers=headers) as response:
                if response.status >= 400:
                    raise RuntimeError(f"POST {url}: HTTP {response.status}: {(await response.text())[:500]}")
                return await response.json(content_type=None)
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as error:
            last = error
            await asyncio.sleep(0.2 * (attempt + 1))
    raise ConnectionError(f"POST {url} failed after {max_retries} tries: {last!r}")


async def get(url: str) -> Any:
    async with _session().get(url) as response:
        if response.status >= 400:
            raise RuntimeError(f"GET {url}: HTTP {response.status}: {(await response.text())[:500]}")
        return await response.json(content_type=None)
