"""Whose actor each of a node's actors is, in a run of several policies (actors.config.policies).

A policy's buffer, learner and evaluator are started once per policy, each with the policy's own settings and its
own run directory (RUN_DIR/policies/<name>), so that their code runs as it does in a run of one policy and writes
the files it always writes where every tool that reads a run directory finds them. The shared roles (controller,
rollout and reward workers, custom actors) are started once, with the whole run's settings and directory. A run
without policies has one scope, the run itself.

A policy with engines of its own (`own_engines: N`) has N rollout workers of its own, started as its actors
("rollout-0-1@NAME"): with its settings, in its directory, each an engine of its model that generates for it alone.
The head starts those of the policies declared at the run's start; the launcher of a policy joining the running job
starts its policy's, on its own node. The shared rollout workers start only where some policy shares the run's
engines.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from actors.config import RunConfig, write_effective_config
from actors.config.policies import POLICY_ROLES, policy_run_dir, scoped_actor_id
from actors.config.run import policy_names, policy_run_config
from actors.runtime.roles import runs_evaluator


@dataclass(frozen=True)
class Scope:
    """What an actor plays for: a policy (None: the whole run), the settings it reads and the directory it writes."""

    policy: str | None
    config: RunConfig
    run_dir: Path

    def actor_id(self, role: str) -> str:
        return scoped_actor_id(role, self.policy)


def policy_scopes(config: RunConfig, run_dir: Path) -> list[Scope]:
    """Each policy's scope in declaration order; the run's own for a run of one unnamed policy."""
    names = policy_names(config)
    if not names:
        return [Scope(None, config, run_dir)]
    return [Scope(name, policy_run_config(config, name), policy_run_dir(run_dir, name)) for name in names]


def role_scopes(role: str, config: RunConfig, run_dir: Path) -> list[Scope]:
    """The scopes that run an actor of `role`: every policy for a policy's role (the evaluator only for a policy
    with eval sets), the run itself for a shared one."""
    if role not in POLICY_ROLES or not policy_names(config):
        return [Scope(None, config, run_dir)]
    return [scope for scope in policy_scopes(config, run_dir) if role != "evaluator" or runs_evaluator(scope.config)]


def role_actors(role: str, count: int, config: RunConfig, run_dir: Path, *, head: bool,
                joining: str | None = None) -> list[tuple[int, Scope]]:
    """(index, scope) of each of this node's actors of `role`, `count` being the node's count of a shared role: a
    policy's role once per policy (`role_scopes`); rollout workers `count` times for the run's shared engines where
    some policy shares them, then on the head each policy's own, as many as its `own_engines`. `joining`: the policy
    whose launcher joins it to the running job, which runs that policy's actors alone, its own rollout workers too."""
    if joining is not None:
        return [(index, scope) for index, scope in role_actors(role, count, config, run_dir, head=True)
                if scope.policy == joining]
    if role != "rollout":
        return [(index, scope) for index in range(count) for scope in role_scopes(role, config, run_dir)]
    scopes = [scope for scope in policy_scopes(config, run_dir) if scope.policy is not None]
    shared = not scopes or any(not scope.config.engine.own_engines for scope in scopes)
    found = [(index, Scope(None, config, run_dir)) for index in range(count)] if shared else []
    if head:
        found += [(index, scope) for scope in scopes for index in range(scope.config.engine.own_engines)]
    return found


def runs_any_evaluator(config: RunConfig) -> bool:
    """Whether an evaluator runs: the run's, or some policy's (each policy's eval sets are its own)."""
    return any(runs_evaluator(scope.config) for scope in policy_scopes(config, Path()))


def write_policy_configs(config: RunConfig, run_dir: Path, only: str | None = None) -> None:
    """Each policy's effective settings in its directory (RUN_DIR/policies/<name>/config.yaml): what its actors read,
    where a tool given the policy's directory looks for them. Nothing for a run of one unnamed policy. `only`: that
    policy's alone (one joining the running job)."""
    for scope in policy_scopes(config, run_dir):
        if scope.policy is not None and only in (None, scope.policy):
            scope.run_dir.mkdir(parents=True, exist_ok=True)
            write_effective_config(scope.config, scope.run_dir)
