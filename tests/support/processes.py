"""Helpers for tests that watch real processes."""

from __future__ import annotations

import os


def alive(pid: int) -> bool:
    """Whether a process with this pid exists (a zombie counts until its parent reaps it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
