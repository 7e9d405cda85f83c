"""Real actors in one test process: each with its own sockets, all on one event loop.

The actor classes are the ones the launcher starts (controller, buffer, reward, rollout, learner), given the
contexts the launcher would give them; only the process boundary is gone, so a test can look inside an actor
(its engine, its buffer core) while the messages between them still cross real ZeroMQ sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

from actors.config import build_config
from actors.launch.node_roles import SINGLETON_ROLES
from actors.runtime.base import Actor
from actors.runtime.context import ActorContext, ActorSettings
from actors.runtime.handlers import handles
from actors.runtime.roles import BUILTIN_ROLES, resolve_actor_class
from bus.address import free_port
from bus.schema import GeneratedGroup
from tools.sim.pipeline import SPEC_ENV, SimSpec

# Longer than any start-up here takes on a loaded machine: only a hang reaches it.
HANG_S = 60.0

SLEEPING = {"rollout_engine": "tools.sim.pipeline:sleeping_engine",
            "train_backend": "tools.sim.pipeline:sleeping_trainer",
            "weight_transport": "tools.sim.pipeline:VERSION_ONLY"}


def write_prompts(path: Path, count: int = 16) -> Path:
    with path.open("w", encoding="utf-8") as handle:
        for index in range(count):
            handle.write(json.dumps({"input": f"What is {index} + 1? Put the answer in \\boxed{{}}.",
                                     "label": str(index + 1)}) + "\n")
    return path


def use_spec(spec: SimSpec, run_dir: Path, monkeypatch: Any) -> None:
    """Point the sleeping engine/trainer factories at `spec`, as the pipeline benchmark does for a launcher."""
    monkeypatch.setenv(SPEC_ENV, str(spec.write(run_dir)))


class GroupRecorder(Actor):
    """Plays the reward role: keeps every group a rollout worker sends on, so a test sees exactly what was sent."""

    def __init__(self, context: ActorContext) -> None:
        super().__init__(context)
        self.groups: list[GeneratedGroup] = []

    @handles(GeneratedGroup)
    async def on_group(self, sender: str, group: GeneratedGroup) -> None:
        self.groups.append(group)


class ActorSystem:
    """The started actors by id; `start()` adds one (also mid-run, as a node joining would); `stop()` asks every
    one to stop and waits for them."""

    def __init__(self) -> None:
        self.actors: dict[str, Actor] = {}
        self.tasks: dict[str, asyncio.Task[int]] = {}
        self.config: Any = None
        self.head = ""
        self.run_dir = Path()

    async def start(self, role: str, kind: str | type[Actor], actor_id: str, *,
                    expected_roles: Mapping[str, int] | None = None) -> Actor:
        """Start one actor with the context the launcher would give it; returns once it registered."""
        if isinstance(kind, str):
            path = BUILTIN_ROLES.get(kind, kind)
            actor_class = resolve_actor_class(path)
        else:
            path, actor_class = f"{kind.__module__}:{kind.__qualname__}", kind
        settings = ActorSettings(log_level="warning", console_log_level="error", run=self.config,
                                 expected_roles=dict(expected_roles or {}))
        context = ActorContext(actor_id=actor_id, role=role, actor_class=path, node_rank=0, head_address=self.head,
                               run_dir=self.run_dir, heartbeat_interval=0.5, settings=settings)
        actor = actor_class(context)
        self.actors[actor_id] = actor
        self.tasks[actor_id] = asyncio.create_task(actor.main(), name=actor_id)
        if role == "controller":  # its sockets are bound before anyone registers
            await self.wait_for(functools.partial(_listening, actor), HANG_S, f"{actor_id} to bind its sockets")
        else:  # one at a time, so what an actor finds at start-up (its peers) does not depend on a race
            await self.wait_for(functools.partial(_registered, self, actor_id), HANG_S,
                                f"{actor_id} to register with the controller")
        return actor

    def __getitem__(self, actor_id: str) -> Any:
        return self.actors[actor_id]

    async def stop(self, timeout: float = 20.0) -> None:
        """In reverse start order, one at a time: each actor's peers (and the controller) are still there for its
        drain and its goodbye, as when a run ends from the learner's side."""
        for actor_id in reversed(list(self.actors)):
            self.actors[actor_id].request_stop("test over")
            task = self.tasks.get(actor_id)
            if task is not None:
                await asyncio.wait([task], timeout=timeout)

    async def wait_for(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not _holds(condition):
            failed = [actor_id for actor_id, task in self.tasks.items() if task.done() and task.result() != 0]
            if failed:
                raise AssertionError(f"actor(s) {failed} exited with an error while waiting for {what}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}")
            await asyncio.sleep(0.05)


def _listening(controller: Actor) -> bool:
    """The controller binds its head address, then its publisher, in one step of its start-up."""
    return getattr(controller, "publisher", None) is not None


def _registered(system: ActorSystem, actor_id: str) -> bool:
    """The controller holds the actor's record and the actor has its answer: its start-up is over (the heartbeat
    starts then), so a stop asked for now is an ordinary stop with a goodbye, not a start-up given up."""
    return actor_id in system.actors["controller"].records and system.actors[actor_id]._heartbeat is not None


def _holds(condition: Callable[[], bool]) -> bool:
    """False, not an error, while an actor has not reached the state the condition reads (before its on_start)."""
    try:
        return condition()
    except AttributeError:
        return False


@contextlib.asynccontextmanager
async def actor_system(run_dir: Path, settings: Mapping[str, Any], roles: Mapping[str, str | type[Actor]]
                       ) -> AsyncIterator[ActorSystem]:
    """Start `roles` (name -> built-in role, class path or class; one actor each) in order, each once the one
    before it registered, the controller first; all are expected by it before the run counts as running."""
    system = ActorSystem()
    system.config = build_config(dict(settings))
    system.head = f"tcp://127.0.0.1:{free_port()}"
    system.run_dir = run_dir
    expected = {role: 1 for role in roles if role != "controller"}
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    try:
        for role, kind in roles.items():
            actor_id = role if role in SINGLETON_ROLES else f"{role}-0-0"
            await system.start(role, kind, actor_id, expected_roles=expected if role == "controller" else {})
        yield system
    finally:
        await system.stop()
