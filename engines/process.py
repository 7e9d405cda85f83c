"""Child processes that do not outlive whoever started them.

Used by every place that forks a long-lived child: the launcher's supervisor (actor processes), the learner (its
extra ranks) and the SGLang launcher (a GPU server). It lives in `engines/` because engines may not import
`actors/`, while actors may import engines.
"""

from __future__ import annotations

import contextlib
import ctypes
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
