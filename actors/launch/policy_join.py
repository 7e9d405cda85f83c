"""A policy joins or leaves a running job, from any node, as a node does (docs/multi-policy.md).

`launcher.py --head-address tcp://HEAD:PORT --run-dir RUN_DIR --join-policy NAME --policy-settings FILE` asks the
head's controller to add policy NAME with the settings in FILE (a YAML mapping of the settings the policy sets for
itself, what would sit under `policies: NAME:` in the run's file), then starts the policy's buffer, learner and
evaluator on this node, and its rollout workers where it has engines of its own (`own_engines: N`, its own model).
Stopping that launcher (SIGTERM, Ctrl-C) makes the policy leave first: its learner checkpoints, and the same command
later joins it again, resumed. `launcher.py --head-address ... --leave-policy NAME` makes any policy leave, one
declared at start included, and starts nothing.

The controller decides (`actors.controller.policy_table`); the checks here run first so that a mistake is one line
on this terminal before anything is asked or started.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path
from typing import Any

import yaml

from actors.config import RunConfig
from actors.config.policies import POLICY_NAME
from actors.launch.node_roles import LaunchError
from actors.runtime.roles import runs_evaluator

ASK_S = 10.0  # how long the controller has to answer a join or a leave
QUIET_ASK_S = 2.0  # a leave once the policy's actors ended: the run may be over, and its controller gone


def add_policy_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("policies joining and leaving a running job (docs/multi-policy.md)")
    group.add_argument("--join-policy", default=None, metavar="NAME",
                       help="with --head-address and --run-dir: policy NAME joins the running job (a run declared "
                            "with policies:), with --policy-settings; this node runs its buffer, learner and "
                            "evaluator (and its rollout workers if it has own_engines), and stopping this launcher "
                            "makes it leave")
    group.add_argument("--policy-settings", type=Path, default=None, metavar="FILE",
                       help="YAML: the settings the joining policy sets for itself (prompt_data, lr, ...), as under "
                            "policies: NAME: in a run's file")
    group.add_argument("--leave-policy", default=None, metavar="NAME",
                       help="with --head-address: policy NAME leaves the running job (its actors stop, its learner "
                            "checkpoints) and the others go on; starts nothing")


def policy_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The joining policy's own settings from --policy-settings; LaunchError names the file and what is wrong."""
    if args.head:
        raise LaunchError("--join-policy joins a running job from another launcher: give --head-address, not --head")
    if not POLICY_NAME.fullmatch(args.join_policy):
        raise LaunchError(f"--join-policy {args.join_policy!r}: a policy name is lower-case letters, digits and _, "
                          "starting with a letter")
    if args.run_dir is None:
        raise LaunchError("--join-policy needs --run-dir: the head's run directory (the policy keeps its files in "
                          "RUN_DIR/policies/NAME, where the head certifies it)")
    path = args.policy_settings
    if path is None:
        return {}
    try:
        settings = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as error:
        raise LaunchError(f"--policy-settings {path}: {error}") from None
    if settings is None:
        return {}
    if not isinstance(settings, dict):
        raise LaunchError(f"--policy-settings {path}: expected a mapping of settings, got {type(settings).__name__}")
    return settings


def with_joining_policy(config: RunConfig, policy: str, settings: dict[str, Any]) -> RunConfig:
    """The run's settings (the head's) with `policy` added, checked as the run's start checks its `policies:`."""
    if not config.policies:
        raise LaunchError(f"--join-policy {policy}: the run at the head has one unnamed policy; policies join a run "
                          "that declared its first ones under policies: (docs/multi-policy.md)")
    if policy in config.policies and config.policies[policy] != settings:
        raise LaunchError(f"--join-policy {policy}: the run declared policy {policy} with other settings "
                          f"({config.policies[policy]})")
    try:
        return config.with_settings(policies={**config.policies, policy: settings})
    except ValueError as error:
        raise LaunchError(f"--join-policy {policy}: {error}") from None


def joining_roles(config: RunConfig, policy: str) -> dict[str, int]:
    """The actors a joining policy's node runs: its buffer, its learner, its evaluator if it has eval sets, and its
    rollout workers if it has engines of its own (`own_engines`; the run's shared ones serve it otherwise)."""
    from actors.config.run import policy_run_config

    own = policy_run_config(config, policy)
    roles = {"buffer": 1, "learner": 1}
    if runs_evaluator(own):
        roles["evaluator"] = 1
    if own.engine.own_engines:
        roles["rollout"] = own.engine.own_engines
    return roles


def ask_to_join(head_address: str, policy: str, settings: dict[str, Any], *, curve_keys: Path | None) -> None:
    """The controller adds the policy, or LaunchError with its reason."""
    from bus.schema import PolicyJoin

    _ask(head_address, PolicyJoin(policy=policy, settings=settings), curve_keys=curve_keys, what=f"join {policy}")


def ask_to_leave(head_address: str, policy: str, reason: str, *, curve_keys: Path | None,
                 timeout: float = ASK_S) -> None:
    from bus.schema import PolicyLeave

    _ask(head_address, PolicyLeave(policy=policy, reason=reason), curve_keys=curve_keys, what=f"leave {policy}",
         timeout=timeout)


async def leave_on_stop(head_address: str, policy: str, reason: str, *, curve_keys: Path | None,
                        quiet: bool = False) -> None:
    """A joining policy's launcher was stopped: the policy leaves first, so the others stop generating for it at
    once and its actors stop on their own (the learner checkpoints); a failure is said and the stop goes on.
    `quiet`: after its actors ended, when the run may be over too and nobody answers (a short wait, nothing said)."""
    timeout = QUIET_ASK_S if quiet else ASK_S
    try:
        await asyncio.to_thread(ask_to_leave, head_address, policy, reason, curve_keys=curve_keys, timeout=timeout)
    except LaunchError as error:
        if not quiet:
            print(f"launcher.py: policy {policy} did not leave cleanly: {error}", flush=True)


def _ask(head_address: str, message: Any, *, curve_keys: Path | None, what: str, timeout: float = ASK_S) -> None:
    reply = asyncio.run(_call(head_address, message, curve_keys, timeout))
    if reply is None:
        raise LaunchError(f"{what}: the controller at {head_address} did not answer within {timeout:.0f}s")
    if not getattr(reply, "ok", False):
        raise LaunchError(f"{what}: refused by the controller: {getattr(reply, 'error', None) or repr(reply)}")


async def _call(head_address: str, message: Any, curve_keys: Path | None, timeout: float) -> Any:
    import zmq.asyncio

    from bus import RpcClient, RpcTimeout, Security

    context = zmq.asyncio.Context()
    security = Security.from_directory(curve_keys) if curve_keys is not None else None
    client = RpcClient(context, head_address, client_id=f"launcher-policy-{os.getpid()}", security=security)
    try:
        return await client.call(message, timeout=timeout)
    except RpcTimeout:
        return None
    finally:
        client.close()
        context.destroy(linger=0)
