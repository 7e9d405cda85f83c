"""Kill points for the chaos matrix: an actor kills itself with SIGKILL (or stalls) the Nth time it reaches a phase.

The plan comes from ``SLIPSTREAM_CHAOS_KILL`` (a test hook, not configuration: the launcher passes its environment
to every actor, forked or fresh), e.g. ``learner@weight_push.mid#2,rollout-0-*@generate.mid#3``: one or more
``TARGET@PHASE[#N][=stall:SECONDS]`` items, TARGET an actor id or role (shell-style wildcards allowed), N counted
from 1 (default 1) within one process. The action is a real kill -9 of the process, or with ``=stall:SECONDS`` a
stall: the reaching thread sleeps, so a phase reached on the event loop freezes the whole actor (heartbeats too),
as a long GC pause, a swapping host or a short SIGSTOP would. Each item fires once per run directory: first the
process leaves ``RUN_DIR/chaos/ITEM.fired`` (JSON: point, actor, pid, phase, n, time), and a restarted process
that finds it stays armed no more, so a kill point never turns into a crash loop, and the chaos tool can tell that
(and when) it fired.

Phases, each placed where the named work is half done:

- ``generate.mid`` rollout worker: a group's generation started and not finished (``during``);
- ``score.mid`` reward worker: a group scored, its scores not yet sent to the buffer;
- ``batch_serve.mid`` buffer: a batch assembled and written to the log, the reply not yet sent;
- ``weight_push.mid`` learner: every bucket of a weight update broadcast, no engine's acknowledgement collected;
- ``checkpoint.mid`` learner: the checkpoint directory written, ``latest`` not yet pointing at it;
- ``weight_load.start`` rollout worker: a weight update ordered, the engine not yet joined or loading;
- ``weight_load.done`` rollout worker: the weights loaded and acknowledged to the sender, the order not yet answered;
- ``engine_serve.mid`` rollout worker: its engine generating for another worker's call (``during``), not yet answered.

Without a plan (or with none for this actor) ``reached`` is one truth test and ``during`` returns its argument.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import json
import os
import signal
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

KILL_ENV = "SLIPSTREAM_CHAOS_KILL"
PHASES = ("generate.mid", "score.mid", "batch_serve.mid", "weight_push.mid", "checkpoint.mid", "weight_load.start",
          "weight_load.done", "engine_serve.mid")
T = TypeVar("T")


class KillPlanError(ValueError):
    """A kill plan that cannot be used; the message names the item at fault."""


@dataclass(frozen=True)
class KillPoint:
    """Kill the actor matching `target` the `nth` time it reaches `phase` (or, `stall_s` > 0, stall it that long)."""

    target: str
    phase: str
    nth: int = 1
    stall_s: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.target}@{self.phase}#{self.nth}" + (f"=stall:{self.stall_s:g}" if self.stall_s else "")

    def matches(self, actor_id: str, role: str) -> bool:
        return fnmatch.fnmatchcase(actor_id, self.target) or fnmatch.fnmatchcase(role, self.target)


def parse_plan(text: str, *, source: str = KILL_ENV) -> list[KillPoint]:
    """``TARGET@PHASE[#N][=stall:SECONDS]`` items separated by commas."""
    points = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        point, equals, action = item.partition("=")
        stall_s = _stall_seconds(action, item, source) if equals else 0.0
        target, at, rest = point.partition("@")
        phase, hash_, nth_text = rest.partition("#")
        if not at or not target or not phase:
            raise KillPlanError(f"{source} item {item!r}: expected TARGET@PHASE[#N], e.g. learner@weight_push.mid#2")
        if phase not in PHASES:
            raise KillPlanError(f"{source} item {item!r}: unknown phase {phase!r} (known: {', '.join(PHASES)})")
        if hash_ and not (nth_text.isdigit() and int(nth_text) >= 1):
            raise KillPlanError(f"{source} item {item!r}: N must be a whole number >= 1, got {nth_text!r}")
        points.append(KillPoint(target=target, phase=phase, nth=int(nth_text) if hash_ else 1, stall_s=stall_s))
    return points


def _stall_seconds(action: str, item: str, source: str) -> float:
    kind, _, seconds = action.partition(":")
    try:
        value = float(seconds)
    except ValueError:
        value = -1.0
    if kind != "stall" or not value > 0:
        raise KillPlanError(f"{source} item {item!r}: the action must be stall:SECONDS (SECONDS > 0), got {action!r}")
    return value


class _Armed:
    """This process's kill points, and how often it has reached each phase."""

    def __init__(self, points: list[KillPoint], actor_id: str, marks: Path) -> None:
        self.points = points
        self.actor_id = actor_id
        self.marks = marks
        self.reached: dict[str, int] = {}

    def reach(self, phase: str) -> None:
        count = self.reached[phase] = self.reached.get(phase, 0) + 1
        for point in self.points:
            if point.phase == phase and point.nth == count and self._claim(point, count):
                if point.stall_s:
                    time.sleep(point.stall_s)
                else:
                    os.kill(os.getpid(), signal.SIGKILL)

    def _claim(self, point: KillPoint, count: int) -> bool:
        """Leave the mark that this point fired (False: an earlier process of this run fired it already)."""
        self.marks.mkdir(parents=True, exist_ok=True)
        path = self.marks / f"{_file_name(point.name)}.fired"
        try:
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            self.points = [p for p in self.points if p != point]
            return False
        record = {"point": point.name, "actor": self.actor_id, "pid": os.getpid(), "phase": point.phase,
                  "n": count, "time": time.time()}
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(record))
            handle.flush()
            os.fsync(handle.fileno())
        return True


_armed: _Armed | None = None


def arm(actor_id: str, role: str, run_dir: Path) -> None:
    """Called once as an actor process starts: keep the plan's points that name this actor and have not fired."""
    global _armed
    text = os.environ.get(KILL_ENV, "").strip()
    if not text:
        _armed = None
        return
    marks = fired_dir(run_dir)
    points = [p for p in parse_plan(text) if p.matches(actor_id, role)
              and not (marks / f"{_file_name(p.name)}.fired").exists()]
    _armed = _Armed(points, actor_id, marks) if points else None


def reached(phase: str) -> None:
    """This actor is at `phase`: a kill point armed for its Nth time here kills the process now (SIGKILL), or
    stalls the calling thread."""
    if _armed is not None:
        _armed.reach(phase)


def during(phase: str, work: Awaitable[T]) -> Awaitable[T]:
    """`work`, with `phase` reached once it has started and before it finishes (unarmed: `work` itself)."""
    if _armed is None or not any(point.phase == phase for point in _armed.points):
        return work
    return _during(phase, work)


async def _during(phase: str, work: Awaitable[T]) -> T:
    task = asyncio.ensure_future(work)
    await asyncio.sleep(0)  # one turn of the loop: the work runs to its first wait
    if not task.done():
        reached(phase)
    return await task


def fired_dir(run_dir: Path) -> Path:
    return run_dir / "chaos"


def fired(run_dir: Path) -> list[dict[str, object]]:
    """The kill points that fired in this run directory, oldest first (for the chaos tool)."""
    records = []
    for path in sorted(fired_dir(run_dir).glob("*.fired")):
        with contextlib.suppress(OSError, ValueError):
            records.append(json.loads(path.read_text(encoding="utf-8")))
    return sorted(records, key=lambda record: float(record.get("time", 0.0)))  # type: ignore[arg-type]


def _file_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.@" else "_" for c in name)
