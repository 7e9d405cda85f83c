"""Fixtures shared by the actor tests."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """A running event loop in its own thread: a rollout worker's loop, while the test plays a rollout function's
    thread (tests/actors/test_rollout_function.py, test_rollout_buffer.py)."""
    running = asyncio.new_event_loop()
    thread = threading.Thread(target=running.run_forever, daemon=True)
    thread.start()
    yield running
    running.call_soon_threadsafe(running.stop)
    thread.join(5)
    running.close()
