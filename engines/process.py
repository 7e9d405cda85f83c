"""Child processes that do not outlive whoever started them, and that end without finalizing what they imported.

Used by every place that forks a long-lived child: the launcher's supervisor (actor processes), the learner (its
extra ranks) and the SGLang launcher (a GPU server). It lives in `engines/` because engines may not import
`actors/`, while actors may import engines.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """A `preexec_fn`: on Linux the child gets SIGTERM when its parent dies, even by SIGKILL.

    Runs between fork and exec, where an exception would fail the spawn, so a platform without prctl just goes
    without. The signal follows the *thread* that forked: fork from a thread that lives as long as the parent.
    """
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def exit_now(code: int) -> None:
    """End this process as an interpreter would, less the finalization of its modules: exit handlers first (they
    stop what it started, e.g. a checkpoint writer's helper process, which would otherwise outlive it holding the
    console's pipes), then the buffered output, then `os._exit`.

    A process that imported torch and transformers spends ~0.7 s tearing their modules down after its work is done
    (measured on a follower learner rank here), and whoever waits for it to end (rank 0's stop, the launcher's)
    waits that long for nothing it needs."""
    try:
        atexit._run_exitfuncs()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os._exit(code)
