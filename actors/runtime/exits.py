"""How an actor process tells its launcher how it ended: its exit code, and for an end that must not be retried, why.

A crash is restarted. A bad configuration would only fail the same way again, and a run that failed (its reward
function fails on everything, the hang detector found no progress) must not go on, so for those two the launcher
fails the run at once and says why, from the one-line report the actor left next to its context file
(RUN_DIR/actors/ID.exit-reason).

An actor also marks that it joined the run (RUN_DIR/actors/ID.joined, once the controller registered it): when the
run finishes, the launcher gives the actors that heard the controller's stop time to leave on their own, and stops
the others (still starting, they never will hear it) at once.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from actors.runtime.context import ActorContext

EXIT_STOPPED = 0  # stopped on purpose, or done
EXIT_CRASHED = 1
EXIT_BAD_CONFIG = 2  # not restarted: the run fails with the actor's report
EXIT_CONTROLLER_UNREACHABLE = 3
EXIT_RUN_FAILED = 4  # not restarted: the run failed (the actor's report says how), every launcher fails with it
FINAL_EXITS = (EXIT_BAD_CONFIG, EXIT_RUN_FAILED)
ABORTED = "aborted by the controller: "  # opens the report of an actor that failed because the run was aborted
# The controller's answer to a member of a run that is ending, or of a policy that left it (it stops, exit 0).
RUN_OVER = ("run_over", "run_failed", "policy_left")


class ControllerUnreachable(RuntimeError):
    """The head address did not answer within the registration deadline (EXIT_CONTROLLER_UNREACHABLE)."""


class RunOver(Exception):
    """The controller turned the registration away: the run is over, nothing is left to join (EXIT_STOPPED, or
    EXIT_RUN_FAILED when the run failed)."""

    def __init__(self, detail: str, *, failed: bool) -> None:
        super().__init__(detail)
        self.failed = failed


def _report_path(context: ActorContext) -> Path:
    return context.run_dir / "actors" / f"{context.actor_id}.exit-reason"


def report_exit(context: ActorContext, message: str, code: int) -> int:
    """Leave `message` for the launcher and return `code` (one of FINAL_EXITS), which makes it read the message."""
    with contextlib.suppress(OSError):  # the exit code still tells the launcher; only the reason would be lost
        path = _report_path(context)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(message, encoding="utf-8")
    return code


def report_bad_config(context: ActorContext, message: str) -> int:
    return report_exit(context, message, EXIT_BAD_CONFIG)


def exit_report(context: ActorContext) -> str | None:
    """The reason an actor that exited with one of FINAL_EXITS left, if any."""
    try:
        return _report_path(context).read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def clear_exit_report(context: ActorContext) -> None:
    """Before a start: a report is about the process that wrote it."""
    with contextlib.suppress(OSError):
        _report_path(context).unlink(missing_ok=True)


def _joined_path(context: ActorContext) -> Path:
    return context.run_dir / "actors" / f"{context.actor_id}.joined"


def report_joined(context: ActorContext) -> None:
    """The controller registered this actor: from now on it hears the run's stop."""
    with contextlib.suppress(OSError):  # without the mark the launcher only stops this actor sooner, by SIGTERM
        path = _joined_path(context)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()


def has_joined(context: ActorContext) -> bool:
    return _joined_path(context).exists()


def clear_joined(context: ActorContext) -> None:
    """Before a start: the mark is about the process that left it."""
    with contextlib.suppress(OSError):
        _joined_path(context).unlink(missing_ok=True)
