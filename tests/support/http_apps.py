"""An aiohttp app served for a test whose client blocks (requests, urllib): on a port of its own, from an event loop
in a thread of its own, stopped when the test is done."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

from aiohttp import web


@contextlib.contextmanager
def served(app: web.Application) -> Iterator[str]:
    """Serve `app` on 127.0.0.1 and yield its base URL."""
    running = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    running.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    running.run_until_complete(site.start())
    thread = threading.Thread(target=running.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), running).result(10)
        running.call_soon_threadsafe(running.stop)
        thread.join(5)
        running.close()
