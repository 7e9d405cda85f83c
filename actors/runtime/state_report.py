"""The hang detector's question to an actor, answered: what it waits for, oldest first, and where every stack is."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from actors.runtime.stacks import dump_stacks
from actors.runtime.waits import Waits
from bus.schema import StateReport, WaitState


def open_waits(waits: Waits, describe_waits: Callable[[], list[WaitState]]) -> list[WaitState]:
    """Every open wait, oldest first; a role's `describe_waits` failing must not stop its heartbeat."""
    try:
        described = describe_waits()
    except Exception as error:
        described = [WaitState(on="?", what=f"describe_waits failed: {error!r}")]
    return sorted([*waits.snapshot(), *described], key=lambda wait: -wait.waited_s)


async def send_state_report(controller: Any, actor_id: str, waits: list[WaitState], log: Any) -> None:
    """To the controller (None: not registered yet, nothing to answer)."""
    if controller is None:
        return
    report = StateReport(actor_id=actor_id, waits=waits, stacks=dump_stacks())
    try:
        await controller.call(report, timeout=2.0, retries=1)
    except Exception as error:  # the controller reports us as not answering; nothing else to do
        log.warning("could not send the state report", error=repr(error))
