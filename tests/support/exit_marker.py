"""Imported by a forked actor in a test: at interpreter exit it writes the file named by $EXIT_MARKER.

Has no actor class, so an actor context naming `tests.support.exit_marker:Missing` fails fast (exit code 2) right
after this import, which is all the test needs: a process that registered an exit handler and ended.
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path


def _mark() -> None:
    Path(os.environ["EXIT_MARKER"]).write_text("exit handlers ran", encoding="utf-8")


atexit.register(_mark)
