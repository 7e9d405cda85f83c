"""A reward model served over HTTP (``--rm-type remote_rm --rm-url URL``), async, with timeouts and retries.

Protocol: ``POST url`` with JSON ``{"prompt", "response", "label", "metadata"}``; the server answers a JSON number
or an object with a ``"reward"`` number (extra fields are kept as extras). Each attempt has its own timeout;
connection errors, timeouts, HTTP 429 and 5xx are retried with exponential backoff (+-10% jitter so many workers
do not retry in lockstep); other 4xx answers and malformed bodies are not retried (asking again will not help).
Exhausted retries raise :class:`RemoteRewardError`, which :func:`policies.rewards.score` records as an error
outcome.
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import aiohttp

from policies.rewards.types import RewardInput

__all__ = ["RemoteRewardError", "RemoteRewardModel"]


class RemoteRewardError(RuntimeError):
    pass


class _Retryable(Exception):
    pass


class RemoteRewardModel:
    """Async callable reward function; one instance (and one connection pool) per reward worker."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 30.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        headers: dict[str, str] | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"rm_url: expected an http(s) URL, got {url!r}")
        if timeout_s <= 0 or max_retries < 0 or backoff_s < 0:
            raise ValueError(
                f"remote reward model: need timeout_s > 0, max_retries >= 0, backoff_s >= 0; "
                f"got {timeout_s}, {max_retries}, {backoff_s}"
            )
        self.url = url
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.headers = dict(headers or {})
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None

    async def __call__(self, inp: RewardInput) -> float | dict[str, Any]:
        payload = {"prompt": inp.prompt, "response": inp.response, "label": inp.label, "metadata": inp.metadata}
        attempts = self.max_retries + 1
        last_error = ""
        for attempt in range(attempts):
            try:
                return await self._post(payload)
            except _Retryable as exc:
                last_error = str(exc)
            if attempt + 1 < attempts:
                delay = min(self.max_backoff_s, self.backoff_s * 2**attempt)
                await asyncio.sleep(delay * random.uniform(0.9, 1.1))
        raise RemoteRewardError(f"{self.url}: {attempts} attempt(s) failed; last: {last_error}")

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _post(self, payload: dict[str, Any]) -> float | dict[str, Any]:
        session = self._current_session()
        try:
            async with session.post(
                self.url, json=payload, timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            ) as response:
                body = await response.text()
                if response.status == 429 or response.status >= 500:
                    raise _Retryable(f"HTTP {response.status}: {body[:200]}")
                if response.status >= 400:
                    raise RemoteRewardError(f"{self.url}: HTTP {response.status} (not retried): {body[:200]}")
        except asyncio.TimeoutError:
            raise _Retryable(f"timed out after {self.timeout_s}s") from None
        except aiohttp.ClientError as exc:
            raise _Retryable(f"{type(exc).__name__}: {exc}") from None
        return _parse_body(self.url, body)

    def _current_session(self) -> aiohttp.ClientSession:
        """A session bound to the running loop (aiohttp sessions cannot cross event loops)."""
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            self._session = aiohttp.ClientSession(headers=self.headers)
            self._session_loop = loop
        return self._session


def _parse_body(url: str, body: str) -> float | dict[str, Any]:
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        raise RemoteRewardError(f"{url}: response is not JSON: {body[:200]!r}") from None
    if isinstance(data, (int, float)) and not isinstance(data, bool):
        return float(data)
    if isinstance(data, dict) and "reward" in data:
        return data
    raise RemoteRewardError(f"{url}: expected a number or an object with 'reward', got {body[:200]!r}")
