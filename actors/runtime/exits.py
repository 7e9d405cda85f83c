"""How an actor process tells its launcher how it ended: its exit code, and for a bad configuration, why.

A crash is restarted; a bad configuration would only fail the same way again, so the launcher fails the run at
once and says why, from the one-line report the actor left next to its context file (RUN_DIR/actors/ID.json).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from actors.runtime.context import ActorContext

EXIT_STOPPED = 0  # stopped on purpose, or done
EXIT_CRASHED = 1
EXIT_BAD_CONFIG = 2  # not restarted: the run fails with the actor's report
EXIT_CONTROLLER_UNREACHABLE = 3


def _report_path(context: ActorContext) -> Path:
    return context.run_dir / "actors" / f"{context.actor_id}.bad-config"


def report_bad_config(context: ActorContext, message: str) -> int:
    """Leave `message` for the launcher and return the exit code that makes it read it."""
    with contextlib.suppress(OSError):  # the exit code still tells the launcher; only the reason would be lost
        path = _report_path(context)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(message, encoding="utf-8")
    return EXIT_BAD_CONFIG


def bad_config_report(context: ActorContext) -> str | None:
    """The reason an actor that exited EXIT_BAD_CONFIG left, if any."""
    try:
        return _report_path(context).read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def clear_bad_config_report(context: ActorContext) -> None:
    """Before a start: a report is about the process that wrote it."""
    with contextlib.suppress(OSError):
        _report_path(context).unlink(missing_ok=True)
