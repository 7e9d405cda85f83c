"""Supervising this node's actor processes: start, restart with bounded backoff, stop without orphans.

Each actor is its own process (`python -m actors.runtime.main CONTEXT.json`) in its own session, so a Ctrl-C in the
terminal reaches only the launcher, which then stops the children in order; children also get SIGTERM if
the launcher itself dies (PR_SET_PDEATHSIG), so no actor outlives its supervisor. An actor that exits 0 is
done; one that crashes is restarted after a growing delay until it has crashed `max_restarts` times within
`window_s`, and then the whole run is failed, because a permanently broken role would otherwise leave the
others waiting forever. One that exits for a bad configuration, or because the run failed (its reward function
fails on everything, the hang detector found no progress: actors.runtime.exits), fails the run at once with the
reason it gave: a restart would only fail the same way. A child found stopped (SIGSTOP) when the run stops is
killed at once and named: it could not act on SIGTERM anyway.

While the run is up, RUN_DIR/pids.json (pids-nodeN.json on a worker node) names this launcher's pid and each live
actor's, rewritten at every start, restart and exit and removed at the end: a script that kills or profiles one
actor of one run reads it, where `pgrep -f` on a title could match the same actor of another run on the machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from actors.config.engines import engine_spec, train_backend_spec
from actors.launch.zygote_client import EarlyTemplate, ForkedProcess, Zygote, ZygoteError, actor_environment
from actors.runtime.context import ActorContext
from actors.runtime.exits import (
    ABORTED,
    EXIT_BAD_CONFIG,
    FINAL_EXITS,
    clear_exit_report,
    clear_joined,
    exit_report,
    has_joined,
)
from actors.runtime.restarts import RestartPolicy
from bus.address import ipc_sockets_dir
from engines.process import die_with_parent

LIGHT_ROLES = ("controller", "buffer", "reward")  # built-in roles that load no model (custom ones may)
# SIGTERM to SIGKILL for the learner: the step in hand and the checkpoint at stop (Learner.drain_timeout is 120 s)
# must fit, or a Ctrl-C loses everything trained since the last periodic checkpoint.
LEARNER_STOP_GRACE_S = 135.0


def holds_a_model(context: ActorContext) -> bool:
    """Whether the actor imports torch and transformers to hold a model, so that the template imports them (once)
    before forking it. A rollout worker imports its engine's factory: the torch engine's or SGLang's for a built-in,
    only the plugin's own module for a plugin (the benchmark's sleeping engine); a learner imports the trainer of a
    built-in backend, not of a plugin. A custom role may hold a model."""
    run = context.settings.run
    if context.role in LIGHT_ROLES:
        return False
    if context.role == "rollout":
        return engine_spec(run.engine.rollout_engine) is not None
    if context.role in ("learner", "learner-ranks"):
        return train_backend_spec(run.trainer.train_backend) is not None
    return True


@dataclass
class Child:
    context: ActorContext
    context_path: Path
    process: asyncio.subprocess.Process | ForkedProcess | None = None
    crashes: deque[float] = field(default_factory=deque)
    consecutive_crashes: int = 0
    restarts: int = 0
    done: bool = False
    exit_code: int | None = None


class Supervisor:
    def __init__(self, contexts: list[ActorContext], *, run_dir: Path, policy: RestartPolicy | None = None,
                 stop_grace_s: float = 15.0, fork_from_template: bool = False,
                 early_template: EarlyTemplate | None = None) -> None:
        """`fork_from_template`: start actors by forking `actors.launch.zygote` (imports done once) rather than
        as fresh interpreters; if the template cannot start, actors start the ordinary way."""
        self.run_dir = run_dir
        self.policy = policy or RestartPolicy()
        self.stop_grace_s = stop_grace_s
        self.children = [Child(context=c, context_path=self._write_context(c)) for c in contexts]
        self.worker_node = not any(c.role == "controller" for c in contexts)  # a node that joined a head elsewhere
        self.log = structlog.get_logger().bind(role="launcher")
        self.failure: str | None = None
        self.stop_signal: int | None = None
        self._stopping = asyncio.Event()
        self._signal_after = 0.0
        self.fork_from_template = fork_from_template
        # Started by the launcher before it knew whether this node forks: ended now if it does not.
        if early_template is not None and not fork_from_template:
            early_template.close()
        self.early_template = early_template if fork_from_template else None
        self.zygote: Zygote | None = None
        node = contexts[0].node_rank if contexts else 0
        self.pids_path = run_dir / ("pids.json" if node == 0 else f"pids-node{node}.json")

    def _write_context(self, context: ActorContext) -> Path:
        directory = self.run_dir / "actors"
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{context.actor_id}.json"
        path.write_text(context.to_json(), encoding="utf-8")
        return path

    async def run(self) -> int:
        """Start every child, supervise until all are done, and return the launcher's exit code."""
        if self.fork_from_template:
            try:
                self.zygote = await Zygote.start(actor_environment(), self.early_template)
            except (ZygoteError, OSError) as error:
                self.log.warning("actor template unavailable; starting actors as new interpreters",
                                 error=str(error))
        # Actors that hold no model first: forked at once, they run while the template imports torch for the rest.
        watchers = []
        for child in sorted(self.children, key=lambda c: holds_a_model(c.context)):
            if self.stopping:
                break  # the run ended (or failed) while this node was still starting its actors
            await self._start(child)
            watchers.append(asyncio.create_task(self._watch(child)))  # an early exit is seen at once
        stopper = asyncio.create_task(self._stop_when_requested())
        await asyncio.gather(*watchers)
        stopper.cancel()
        if self.zygote is not None:
            await self.zygote.close()
        self._remove_stale_sockets()
        self.pids_path.unlink(missing_ok=True)  # its pids may belong to other processes by now
        if self.failure is not None:
            self.log.error("run failed", reason=self.failure.splitlines()[0])  # launcher.py prints all of it
            return 1
        if self.stop_signal is not None:
            return 128 + self.stop_signal
        return 0

    def request_stop(self, reason: str, *, signum: int | None = None, grace_s: float = 0.0) -> None:
        """Stop every child: SIGTERM after `grace_s` (time to exit on their own), SIGKILL after its grace more (the
        learner's is longer: it finishes its step and writes its checkpoint). A second signal kills them now."""
        if signum is not None and self.stop_signal is not None:
            self.log.warning("second signal: killing every actor now", signal=signal.Signals(signum).name)
            self._kill_all()
            return
        if signum is not None:
            self.stop_signal = signum
        if not self._stopping.is_set():
            self.log.info("stopping actors", reason=reason.splitlines()[0])
            self._signal_after = grace_s
            self._stopping.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def pids(self) -> dict[str, int]:
        return {c.context.actor_id: c.process.pid for c in self.children
                if c.process is not None and c.process.returncode is None}

    def _write_pids(self) -> None:
        """RUN_DIR/pids.json as it is now, replaced whole (a reader never sees half a file)."""
        partial = self.pids_path.with_suffix(".json.partial")
        partial.write_text(json.dumps({"launcher": os.getpid(), "actors": self.pids()}, indent=1), encoding="utf-8")
        partial.replace(self.pids_path)

    async def _start(self, child: Child) -> None:
        env = actor_environment(child.context.cuda_visible_devices)
        clear_exit_report(child.context)
        clear_joined(child.context)
        child.process = await self._fork(child, env) or await asyncio.create_subprocess_exec(
            sys.executable, "-m", "actors.runtime.main", str(child.context_path),
            start_new_session=True, preexec_fn=die_with_parent, env=env,
        )
        self.log.info("actor process started", actor=child.context.actor_id, pid=child.process.pid,
                      restarts=child.restarts)
        self._write_pids()

    async def _watch(self, child: Child) -> None:
        while True:
            assert child.process is not None
            code = await child.process.wait()
            child.exit_code = code
            self._write_pids()
            actor = child.context.actor_id
            if self.stopping or code == 0:
                child.done = True
                self.log.info("actor exited", actor=actor, code=code)
                if code == 0 and child.context.role == "controller" and not self.stopping:
                    # The controller broadcast "stop" before it exited: let the actors leave on their own first.
                    self.request_stop("the controller finished the run", grace_s=self.stop_grace_s)
                elif code == 0 and self.worker_node and not self.stopping:
                    # No controller here: an actor leaves on its own only when the head's controller stopped the
                    # run. The rest of this node goes too, including an actor that joined too late to hear it.
                    self.request_stop(f"the run ended ({actor} was stopped by the controller)",
                                      grace_s=self.stop_grace_s)
                return
            if code in FINAL_EXITS:
                why = exit_report(child.context) or f"see {child.context.log_dir / actor}.jsonl"
                if code == EXIT_BAD_CONFIG:
                    why = f"{actor}: bad configuration: {why}"
                elif not why.startswith(ABORTED):  # an abort's reason names who failed the run, not this actor
                    why = f"{actor}: {why}"
                self.fail(why)
                child.done = True
                return
            if not self._may_restart(child):
                self.fail(f"{actor} crashed {len(child.crashes)} times within {self.policy.window_s:.0f}s "
                           f"(last exit code {code})")
                child.done = True
                return
            delay = self.policy.backoff(child.consecutive_crashes)
            self.log.warning("actor crashed; restarting", actor=actor, code=code, delay_s=delay,
                             restarts=child.restarts + 1)
            try:
                await asyncio.wait_for(self._stopping.wait(), delay)
                child.done = True
                return
            except asyncio.TimeoutError:
                pass
            child.restarts += 1
            await self._start(child)

    async def _fork(self, child: Child, env: dict[str, str]) -> ForkedProcess | None:
        """The actor forked from the template, or None to start it as a new interpreter."""
        if self.zygote is None or not self.zygote.alive:
            return None
        try:
            return await self.zygote.spawn(str(child.context_path), env,
                                           heavy=holds_a_model(child.context))
        except ZygoteError as error:
            self.log.warning("forking from the actor template failed; starting a new interpreter",
                             actor=child.context.actor_id, error=str(error))
            return None

    def _may_restart(self, child: Child) -> bool:
        now = time.monotonic()
        child.crashes.append(now)
        while child.crashes and now - child.crashes[0] > self.policy.window_s:
            child.crashes.popleft()
        child.consecutive_crashes += 1
        return len(child.crashes) <= self.policy.max_restarts

    def fail(self, reason: str) -> None:
        """Fail the run: stop every child and exit 1 with `reason` (the first one given). Called for an actor's
        final exit or crash loop, and from outside the actors (this node lost its head)."""
        if self.failure is None:
            self.failure = reason
        self.request_stop(reason)

    async def _stop_when_requested(self) -> None:
        await self._stopping.wait()
        running = [c for c in self.children if c.process is not None and c.process.returncode is None]
        # Time to leave on their own for the actors that heard the stop: one that never joined the run (still
        # starting, or started as the run ended) never will, and would only make the run wait out the grace.
        leaving = [c for c in running if has_joined(c.context)]
        if self._signal_after > 0 and leaving:
            await asyncio.wait([asyncio.ensure_future(c.process.wait()) for c in leaving],  # type: ignore[union-attr]
                               timeout=self._signal_after)
            running = [c for c in running if c.process.returncode is None]  # type: ignore[union-attr]
        for child in running:
            with contextlib.suppress(ProcessLookupError):
                child.process.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
            if process_state(child.process.pid) in STOPPED_STATES:  # type: ignore[union-attr]
                self.log.warning("actor was stopped (SIGSTOP or a debugger); killing it",
                                 actor=child.context.actor_id, pid=child.process.pid)  # type: ignore[union-attr]
                with contextlib.suppress(ProcessLookupError):
                    child.process.kill()  # type: ignore[union-attr]
        started = time.monotonic()
        for child in running:
            assert child.process is not None
            deadline = started + self._grace_of(child)
            try:
                await asyncio.wait_for(child.process.wait(), max(0.1, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                self.log.warning("actor ignored SIGTERM; killing", actor=child.context.actor_id)
                with contextlib.suppress(ProcessLookupError):
                    child.process.kill()
                await child.process.wait()

    def _grace_of(self, child: Child) -> float:
        return max(self.stop_grace_s, LEARNER_STOP_GRACE_S if child.context.role == "learner" else 0.0)

    def _kill_all(self) -> None:
        for child in self.children:
            if child.process is not None and child.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    child.process.kill()

    def _remove_stale_sockets(self) -> None:
        """The ipc sockets of the run's actors, in its folder and in each policy's (actors bind under their own)."""
        folders = {ipc_sockets_dir(self.run_dir), *(ipc_sockets_dir(c.context.run_dir) for c in self.children)}
        for sockets in folders:
            for path in sockets.glob("*.sock") if sockets.is_dir() else ():
                with contextlib.suppress(OSError):
                    path.unlink()


STOPPED_STATES = ("T", "t")  # /proc/PID/stat: stopped by a signal, or by a tracer


def process_state(pid: int) -> str | None:
    """The one-letter state of a process (R, S, D, T, Z, ...) from /proc, or None where there is no /proc entry."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split(" ", 1)[0]  # the name, in parentheses, may hold spaces
