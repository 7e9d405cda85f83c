"""The hang detector: when did the run last make progress, and, once it has made none for too long, why not.

Every actor counts the work it finished and sends the count with its heartbeat (actors.runtime.waits). The run
progresses while any count grows, or an actor registers, or the learner announces a version; when none of that
happened for `--hang-timeout` seconds (`--start-timeout` while the run is still starting: loading a large model is
not a hang), the controller asks every actor what it waits for and where its stacks are, and fails the run with
`HangReport`: first the actors that went silent (no heartbeat, but never left: a
stopped process, one stuck outside Python, or a lost node), then each live actor's open waits, oldest first.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from bus.schema import Member, StateReport, WaitState

SUMMARY_LINES = 12  # actors named in the one-paragraph error; the report file names all of them


class HangWatch:
    """The moment of the run's last progress; `paused` holds it still (a run paused on purpose is not hung)."""

    def __init__(self, timeout_s: float, now: float, *, start_timeout_s: float = 0.0) -> None:
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self.last_progress = now
        self.paused = False
        self._counts: dict[tuple[str, int], int] = {}  # (actor, incarnation) -> the progress count last heard

    def heartbeat(self, actor_id: str, incarnation: int, progress: int, now: float) -> None:
        """A count above the last one heard from the same process is progress (a new process starts from 0)."""
        key = (actor_id, incarnation)
        if progress > self._counts.get(key, 0):
            self.last_progress = now
        self._counts[key] = progress
        for stale in [k for k in self._counts if k[0] == actor_id and k[1] < incarnation]:
            del self._counts[stale]

    def progressed(self, now: float) -> None:
        """Something other than a count moved the run on (a registration, a version)."""
        self.last_progress = now

    def resume(self, now: float) -> None:
        self.paused = False
        self.last_progress = now

    def stalled_for(self, now: float) -> float:
        return 0.0 if self.paused else now - self.last_progress

    def limit(self, *, starting: bool) -> float:
        """The allowed stall now (0: none is watched)."""
        return self.start_timeout_s if starting else self.timeout_s

    def hung(self, now: float, *, starting: bool = False) -> bool:
        limit = self.limit(starting=starting)
        return limit > 0 and self.stalled_for(now) >= limit


@dataclass(frozen=True)
class ActorView:
    """What the controller knows of one actor when the run is found hung."""

    member: Member
    silent_s: float  # since its last heartbeat
    waits: list[WaitState]  # from its state report if it answered, else from its last heartbeat
    stacks: str | None  # None: it did not answer the state request
    left: bool = False  # stopped on purpose (Leave): not a suspect


@dataclass(frozen=True)
class HangReport:
    summary: str  # one paragraph: the error the run fails with
    text: str  # everything, stacks included: RUN_DIR/hang-report.txt


def hang_report(stalled_s: float, limit_s: float, views: Iterable[ActorView], *,
                missing_roles: dict[str, int] | None = None) -> HangReport:
    """`missing_roles` (role -> actors not registered yet) makes it a report of a run that never finished starting."""
    views = sorted(views, key=lambda v: v.member.actor_id)
    silent = [v for v in views if not v.member.alive and not v.left]
    live = [v for v in views if v.member.alive]
    lines = [_silent_line(v) for v in silent] + [_live_line(v) for v in live]
    named = lines[:SUMMARY_LINES]
    if len(lines) > SUMMARY_LINES:
        named.append(f"... and {len(lines) - SUMMARY_LINES} more")
    if missing_roles:
        missing = ", ".join(f"{role} x{count}" for role, count in sorted(missing_roles.items()))
        head = (f"the run did not finish starting: no actor registered for {stalled_s:.0f} s (--start-timeout "
                f"{limit_s:g}); never registered: {missing}")
    else:
        head = f"no progress for {stalled_s:.0f} s (--hang-timeout {limit_s:g})"
    if silent:
        head += "; silent: " + ", ".join(v.member.actor_id for v in silent)
    summary = head + "\n  " + "\n  ".join(named) if named else head
    stacks = [f"===== {v.member.actor_id}\n{v.stacks}" for v in live if v.stacks]
    text = "\n".join([head, "", *lines, "", "Stacks of the actors that answered:", *stacks]) + "\n"
    return HangReport(summary=summary, text=text)


def report_views(members: Iterable[tuple[Member, float, list[WaitState], bool]],
                 reports: dict[str, StateReport]) -> list[ActorView]:
    """Join the registry (member, seconds silent, waits of its last heartbeat, left on purpose) with the answers."""
    views = []
    for member, silent_s, waits, left in members:
        answer = reports.get(member.actor_id)
        views.append(ActorView(member=member, silent_s=silent_s, left=left,
                               waits=list(answer.waits) if answer is not None else waits,
                               stacks=answer.stacks if answer is not None else None))
    return views


def _silent_line(view: ActorView) -> str:
    member = view.member
    return (f"{member.actor_id} (pid {member.pid} on {member.node}): no heartbeat for {view.silent_s:.0f} s and "
            f"never left: stopped, stuck outside Python, or its node is gone"
            + (f"; last heard waiting for {_waits(view.waits)}" if view.waits else ""))


def _live_line(view: ActorView) -> str:
    doing = f"waits for {_waits(view.waits)}" if view.waits else "waits for nothing it reports"
    unanswered = "" if view.stacks is not None else " (did not answer the state request)"
    return f"{view.member.actor_id}: {doing}{unanswered}"


def _waits(waits: list[WaitState]) -> str:
    return "; ".join(f"{wait.on}: {wait.what} ({wait.waited_s:.0f} s)" for wait in waits[:3]) + (
        f"; and {len(waits) - 3} more" if len(waits) > 3 else "")
