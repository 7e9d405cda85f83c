"""Every Python stack of this process as text: each thread's frames and each asyncio task's coroutine chain.

A hang report needs to say where each actor is, not only what it says it waits for: a deadlock inside a thread
(a collective that never returns, a lock) shows in the thread stacks, a lost wake-up in the task stacks. The
text is bounded, because it travels over the bus in a StateReport.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import traceback
from collections.abc import Iterator
from types import FrameType
from typing import Any

MAX_STACK_CHARS = 48_000
TASK_FRAMES = 12


def dump_stacks(limit: int = MAX_STACK_CHARS) -> str:
    """Thread stacks first (innermost frame last), then the running loop's tasks; cut to `limit` characters."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {names.get(ident, '?')} ({ident})\n{''.join(traceback.format_stack(frame))}")
    try:
        tasks = sorted(asyncio.all_tasks(), key=lambda task: task.get_name())
    except RuntimeError:  # no running loop in this thread
        tasks = []
    for task in tasks:
        frames = list(_await_chain(task.get_coro()))[:TASK_FRAMES]
        chain = "".join(f"  {f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}\n" for f in frames)
        parts.append(f"--- task {task.get_name()}\n{chain or '  (not started)'}")
    text = "\n".join(parts)
    return text if len(text) <= limit else text[:limit] + f"\n... cut at {limit} characters"


def _await_chain(awaitable: Any) -> Iterator[FrameType]:
    """The frames of a suspended coroutine and of what it awaits, outermost first (`Task.get_stack` stops at the
    task's own coroutine)."""
    while awaitable is not None:
        frame = getattr(awaitable, "cr_frame", None) or getattr(awaitable, "gi_frame", None)
        if frame is None:
            return
        yield frame
        awaitable = getattr(awaitable, "cr_await", None) or getattr(awaitable, "gi_yieldfrom", None)
