"""A colocated SGLang server's memory, handed to the learner between turns and taken back before it is needed.

With `--colocate` the server shares the learner's GPU. When the rollout worker has nothing to generate (the
learner is training on the batch it just made), `on_idle` releases the memory tags the run chose
(`/release_memory_occupation`): the KV cache and CUDA graphs always, the weights too where the server backs
them up to the CPU. Before the next generation, or before a weight update writes into the weights,
`take_back_memory` resumes them. A mixin of `SglangEngine`, apart because it is one job.

SGLang's scheduler asserts that it is idle when asked to release, and a failed assertion there takes the server
down, so a release first flushes the cache (which SGLang refuses while any request runs) and happens under a lock
that `generate` takes too: a release never overlaps a request of this client, nor a weight load
(`memory_pinned`). Resuming a tag SGLang does not hold released fails in its scheduler too, so the client
resumes exactly the tags it released, and forgets them when the server restarts (a new server holds them all).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable
from typing import Any

from engines.sglang import protocol
from engines.sglang.protocol import Endpoint

RELEASE_FLUSH_DEADLINE_S = 10.0  # how long a release waits for the server to finish what it was running


class MemoryTurns:
    restarts: int
    _inflight: dict[str, Any]

    async def _call(self, endpoint: Endpoint, *, timeout: float | None = None, **fields: Any) -> Any:
        raise NotImplementedError

    async def flush_cache(self, deadline_s: float) -> None:
        raise NotImplementedError

    def _init_memory_turns(self, release_tags: Iterable[str]) -> None:
        self.release_tags = tuple(release_tags)
        unknown = sorted(set(self.release_tags) - set(protocol.MEMORY_TAGS))
        if unknown:
            raise ValueError(f"release_tags {unknown}: SGLang's memory tags are {list(protocol.MEMORY_TAGS)}")
        self.memory_releases = 0
        self._memory_released: tuple[str, ...] = ()
        self._memory_released_on_start = 0  # `restarts` when the tags were released: a restarted server holds them all
        self._memory_lock: asyncio.Lock | None = None
        self._memory_pins = 0  # weight loads under way: no release until they end

    @property
    def released_memory(self) -> tuple[str, ...]:
        """The memory tags the server holds released now, as far as this client knows."""
        return self._memory_released if self._memory_released_on_start == self.restarts else ()

    async def on_idle(self) -> None:
        """Nothing to generate: in a colocated run, hand the server's memory to the learner until it is needed."""
        if not self.release_tags or self.released_memory:
            return
        async with self._memory_turn():
            if self._inflight or self._memory_pins or self.released_memory:
                return
            await self.flush_cache(deadline_s=RELEASE_FLUSH_DEADLINE_S)
            await self._call(protocol.RELEASE_MEMORY, tags=list(self.release_tags))
            self._memory_released, self._memory_released_on_start = self.release_tags, self.restarts
            self.memory_releases += 1

    async def take_back_memory(self, tags: Iterable[str] | None = None) -> None:
        """Resume the released `tags` (every released one by default); returns at once when none is released."""
        if not self.release_tags:  # never releases: nothing to take back (the lock is for a release under way)
            return
        chosen = None if tags is None else tuple(tags)
        async with self._memory_turn():
            wanted = [tag for tag in self.released_memory if chosen is None or tag in chosen]
            if not wanted:
                return
            await self._call(protocol.RESUME_MEMORY, tags=wanted)
            self._memory_released = tuple(tag for tag in self._memory_released if tag not in wanted)

    @contextlib.asynccontextmanager
    async def memory_pinned(self) -> AsyncIterator[None]:
        """No release while the block runs: a weight load takes back the weights it writes into, and an idle
        worker must not hand them over again before the load is done."""
        self._memory_pins += 1
        try:
            yield
        finally:
            self._memory_pins -= 1

    @contextlib.asynccontextmanager
    async def health_check_turn(self) -> AsyncIterator[bool]:
        """Whether a health check may generate now, held for the check. Not while memory is released: SGLang's
        `/health` generates a token, which needs the KV cache; and not during a release, which SGLang's scheduler
        asserts finds it idle (a health check's request would fail the assertion and take the server down)."""
        if not self.release_tags:
            yield True
            return
        async with self._memory_turn():
            yield not self.released_memory

    def _memory_turn(self) -> asyncio.Lock:
        if self._memory_lock is None:  # made in the loop that uses it
            self._memory_lock = asyncio.Lock()
        return self._memory_lock
