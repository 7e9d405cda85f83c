"""Which actors a node of the run starts, by role, and which ones the head expects from the other nodes.

Three kinds of node run the same `launcher.py` command: the head (controller, buffer, evaluator when the run has
eval data, learner, its rollout and reward workers), a learner node (rank 1 .. --actor-num-nodes - 1: its learner
ranks first, then an engine per --rollout-num-gpus-per-engine of the GPUs they leave), and a rollout node (rollout
and reward workers). Under a
scheduler every node runs one command, so the head can work out what each other node will start and have its
controller expect exactly that: the run is "starting" until those actors registered, its start-up report
names the missing ones, and the hang detector keeps its longer start-up limit until then.
"""

from __future__ import annotations

import argparse

from actors.config import RunConfig
from actors.config.engines import engine_needs_gpu
from actors.config.policies import sharing_engines
from actors.config.run import learner_ranks_per_node
from actors.launch.policy_scopes import runs_any_evaluator
from actors.runtime.roles import BUILTIN_ROLES, HEAD_ROLES
from engines.devices import visible_gpus

SINGLETON_ROLES = ("controller", "buffer", "evaluator", "learner")
SCALED_ROLES = {"rollout": "rollout_workers", "reward": "reward_workers"}  # role -> its count's argument


class LaunchError(Exception):
    """A problem with the command line or this node, reported as one line before anything starts."""


def node_roles(args: argparse.Namespace, customs: dict[str, str]) -> dict[str, int]:
    """Role -> how many of its actors this node runs, in start order (the controller first)."""
    default_roles = list(HEAD_ROLES) if args.head else list(SCALED_ROLES)
    roles = [r.strip() for r in args.roles.split(",") if r.strip()] if args.roles else default_roles
    roles += [name for name in customs if name not in roles]
    known = set(BUILTIN_ROLES) | set(customs)
    for role in roles:
        if role not in known:
            raise LaunchError(f"--roles: unknown role {role!r}; known: {', '.join(sorted(known))}")
    if "controller" in roles and not args.head:
        raise LaunchError("--roles controller needs --head (the controller lives on the head node)")

    counts: dict[str, int] = {}
    for role in roles:
        if role in customs:
            counts[role] = getattr(args, f"{role}_workers")
        elif role in SCALED_ROLES:
            counts[role] = getattr(args, SCALED_ROLES[role])
        else:
            counts[role] = 1
        if counts[role] < 0:
            raise LaunchError(f"number of {role} actors must be >= 0, got {counts[role]}")
    return counts


def is_learner_node(config: RunConfig, *, head: bool, node_rank: int) -> bool:
    return not head and 0 < node_rank < config.placement.actor_num_nodes


def node_actor_counts(args: argparse.Namespace, customs: dict[str, str], config: RunConfig) -> dict[str, int]:
    """`node_roles` for the node `args` describe, with its default rollout workers and, on a learner node, its
    learner ranks first."""
    learner_node = is_learner_node(config, head=args.head, node_rank=args.node_rank)
    rollout_workers = args.rollout_workers
    if rollout_workers is None:
        rollout_workers = default_rollout_workers(config, head=args.head, learner_node=learner_node)
    counts = node_roles(argparse.Namespace(**{**vars(args), "rollout_workers": rollout_workers}), customs)
    if not runs_any_evaluator(config):
        counts.pop("evaluator", None)
    if "rollout" in counts and config.policies and not sharing_engines(config.policies):
        counts["rollout"] = 0  # every policy generates on engines of its own (own_engines), started on the head
    if learner_node and args.roles is None:
        counts = {"learner-ranks": 1, **counts}
    return counts


def worker_node_roles(args: argparse.Namespace, customs: dict[str, str], nodes: int | None,
                      config: RunConfig) -> dict[str, int]:
    """On the head of a scheduled job of `nodes` nodes, the actors the other nodes run in all, by role: every
    node runs this same command, so each runs what it gives a node of its rank (learner nodes included) on
    hardware like this node's (a scheduler's job is homogeneous)."""
    if not nodes or nodes < 2:
        return {}
    totals: dict[str, int] = {}
    for rank in range(1, nodes):
        worker = argparse.Namespace(**{**vars(args), "head": False, "node_rank": rank})
        try:
            counts = node_actor_counts(worker, customs, config)
        except LaunchError:  # --roles that only the head can run (the controller): no worker node joins
            return {}
        for role, count in counts.items():
            if count:
                totals[role] = totals.get(role, 0) + count
    return totals


def default_rollout_workers(config: RunConfig, *, head: bool, learner_node: bool = False) -> int:
    """Rollout workers on a node when --rollout-workers is not given. The head: --rollout-num-gpus /
    --rollout-num-gpus-per-engine when that is given (the rest of its GPUs train), else 1. Any other node is a
    rollout node: one engine per --rollout-num-gpus-per-engine of its GPUs, and 1 without GPUs; a node of the
    learner (`learner_node`) counts only the GPUs its learner ranks leave, and runs no engine when none are left.
    A node attached to running SGLang servers runs one worker per server (--sglang-url, or on the head the servers
    --sglang-router-url listed); another node given that router runs none (`actors/launch/router_servers.py`)."""
    if config.engine.sglang_url:
        return len(config.engine.sglang_url)
    if config.engine.sglang_router_url is not None:
        return 0
    per_engine = config.engine.rollout_num_gpus_per_engine
    if head:
        rollout_gpus = config.placement.rollout_num_gpus
        return rollout_gpus // per_engine if rollout_gpus is not None else 1
    gpus = node_gpus(config)
    if learner_node and gpus:
        return max(0, gpus - learner_ranks_per_node(config)) // per_engine
    if gpus < per_engine:
        return 1
    try:
        return gpus // per_engine if engine_needs_gpu(config.engine.rollout_engine) else 1
    except ValueError as error:
        raise LaunchError(f"--rollout-engine: {error}") from None


def node_gpus(config: RunConfig) -> int:
    """The GPUs this node may use: those it sees, at most --num-gpus-per-node."""
    seen = visible_gpus()
    return seen if config.placement.num_gpus_per_node is None else min(config.placement.num_gpus_per_node, seen)
