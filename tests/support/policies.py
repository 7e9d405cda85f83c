"""Actors of a run of several policies, started in process as the launcher starts them (`tests.support.inprocess`
starts a run of one): a policy's actor gets its scoped id, its policy's settings and its own run directory."""

from __future__ import annotations

import asyncio
from typing import Any

from actors.config.policies import scoped_actor_id
from actors.config.run import policy_run_config
from actors.runtime.base import Actor
from actors.runtime.context import ActorContext, ActorSettings
from actors.runtime.roles import BUILTIN_ROLES, resolve_actor_class
from tests.support.inprocess import HANG_S, ActorSystem


async def start_actor(system: ActorSystem, role: str, kind: str | type[Actor], *, policy: str | None,
                      joined: dict[str, Any] | None = None) -> Any:
    """Start one actor of `role` (a built-in role's name or a class); returns once it registered. `policy`: a
    policy's actor ("learner@a", run directory RUN_DIR/policies/a); None: a shared one ("reward-0-0"). `joined`: the
    settings of a policy that joined the running job, which the run's settings do not hold."""
    actor_id = scoped_actor_id(role, policy) if policy else f"{role}-0-0"
    path = BUILTIN_ROLES[kind] if isinstance(kind, str) else f"{kind.__module__}:{kind.__qualname__}"
    run = policy_run_config(system.config, policy, joined) if policy else system.config
    context = ActorContext(
        actor_id=actor_id, role=role, actor_class=path, node_rank=0, head_address=system.head,
        run_dir=system.run_dir / "policies" / policy if policy else system.run_dir, heartbeat_interval=0.5,
        settings=ActorSettings(log_level="warning", console_log_level="error", run=run), policy=policy)
    actor = resolve_actor_class(path)(context)
    system.actors[actor_id] = actor
    system.tasks[actor_id] = asyncio.create_task(actor.main(), name=actor_id)
    await system.wait_for(lambda: actor_id in system["controller"].records and actor._heartbeat is not None,
                          HANG_S, f"{actor_id} to register")
    return actor
