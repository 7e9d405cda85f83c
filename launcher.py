"""Start and supervise this node's Slipstream actors: `python launcher.py --head ...` on the first node,
`python launcher.py --head-address tcp://HOST:PORT --node-rank N ...` on every other. Under Slurm, a
LeaderWorkerSet or a torchrun-style job, the same command on every node: each reads its place from the
scheduler's environment (`actors/launch/cluster_env.py`, docs/cluster.md).

Each actor runs as its own process; the launcher restarts crashed ones with backoff, turns SIGINT/SIGTERM
into an orderly stop of all of them, and exits 0 when the run finished, 1 when it failed, 128+signal when it
was interrupted.
"""

from __future__ import annotations

import sys

from actors.launch.zygote_client import EarlyTemplate

# First, before the imports below: the actor template of a node that runs a learner (the head, a joining policy's)
# starts now, ready when the first actor is forked.
EARLY_TEMPLATE = EarlyTemplate.for_learner(sys.argv[1:]) if __name__ == "__main__" else None

import argparse
import asyncio
import dataclasses
import os
import re
import signal
import socket
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

from actors.config import RunConfig, add_config_flags, config_from_args, split_sglang_args, write_effective_config
from actors.config.engines import engine_needs_gpu, weight_backend
from actors.config.flag_parser import FlagParser
from actors.config.help import USAGE, HelpFormatter, add_help_flags
from actors.config.policies import run_dir_policies
from actors.config.preflight import preflight
from actors.config.run import learner_ranks_per_node
from actors.config.settings_errors import SettingsError
from actors.launch import cluster_env
from actors.launch.head_settings import HeadSettingsError, fetch_head_settings
from actors.launch.head_watch import stop_node_when_head_lost
from actors.launch.node_roles import (
    SINGLETON_ROLES,
    LaunchError,
    node_actor_counts,
    node_gpus,
    worker_node_roles,
)
from actors.launch.placement import (
    NodePlacement,
    PlacementError,
    place_node,
    visible_devices,
)
from actors.launch.policy_join import (
    add_policy_flags,
    ask_to_join,
    ask_to_leave,
    joining_roles,
    leave_on_stop,
    policy_settings,
    with_joining_policy,
)
from actors.launch.policy_scopes import Scope, role_actors, write_policy_configs
from actors.launch.resume import interrupted_note, resume_command, resume_step
from actors.launch.router_servers import attach_router_servers
from actors.launch.supervisor import Supervisor
from actors.report.progress import Followed, ProgressStart, follow_learners
from actors.report.run_clock import RunClock
from actors.runtime.context import ActorContext, ActorSettings
from actors.runtime.cpu_budget import CpuShare, describe_cpu_budget, plan_cpu_budget, usable_cores
from actors.runtime.restarts import RestartPolicy
from actors.runtime.roles import BUILTIN_ROLES, resolve_actor_class
from bus.address import free_port
from bus.security import CurveKeyError, CurveKeys
from policies.plugins import put_working_directory_on_path

CUSTOM_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def build_parser(custom_names: Sequence[str] = ()) -> argparse.ArgumentParser:
    parser = FlagParser(
        prog="launcher.py", usage=USAGE, add_help=False,
        description="Run this node's Slipstream actors (controller, buffer, learner, rollout and reward "
                    "workers, custom actors) and supervise them.",
        formatter_class=HelpFormatter, allow_abbrev=False)
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--head", action="store_true",
                         help="this node is the head: it runs the controller at --head-address")
    cluster.add_argument("--head-address", default=None, metavar="tcp://HOST:PORT",
                         help="the controller's endpoint (head: where to bind, default a free port on "
                              "127.0.0.1; other nodes: where to connect, required)")
    cluster.add_argument("--node-rank", type=int, default=0, metavar="N", help="this node's index, 0 on the head")
    cluster.add_argument("--host", default=None, metavar="ADDRESS",
                         help="address this node's actors bind and advertise (default 127.0.0.1; under a "
                              "scheduler, this node's address on the network that reaches the head)")
    cluster.add_argument("--rendezvous-file", type=Path, default=None, metavar="PATH",
                         help="a file on a shared filesystem: the head writes the address it bound there, the "
                              "other nodes read it (no --head-address, no agreed port)")
    cluster.add_argument("--transport", choices=("tcp", "ipc"), default="tcp",
                         help="transport of this node's actor endpoints (ipc only when every peer is local)")
    cluster.add_argument("--curve-keys", type=Path, default=None, metavar="DIR",
                         help="directory made by tools/keygen.py: authenticate and encrypt the bus with CURVE")
    cluster.add_argument("--connect-timeout", type=float, default=30.0, metavar="SECONDS",
                         help="seconds to wait for the head before giving up (non-head nodes)")
    cluster.add_argument("--head-loss-timeout", type=float, default=60.0, metavar="SECONDS",
                         help="non-head nodes: seconds the head may refuse connections before this node stops "
                              "and fails, naming the checkpoint to resume from (0: never; the actors then wait "
                              "out --hang-timeout)")
    cluster.add_argument("--heartbeat-interval", type=float, default=1.0, metavar="SECONDS",
                         help="seconds between heartbeats; a member silent for 5 intervals is declared dead")

    actors = parser.add_argument_group("actors")
    actors.add_argument("--roles", default=None, metavar="ROLE,ROLE",
                        help="comma-separated roles to run on this node (default: all built-in roles on the "
                             "head, the scaled roles elsewhere)")
    actors.add_argument("--rollout-workers", type=int, default=None, metavar="N",
                        help="rollout workers on this node (default: on the head --rollout-num-gpus / "
                             "--rollout-num-gpus-per-engine when that is given, else 1; on any other node one "
                             "per --rollout-num-gpus-per-engine of its GPUs, 1 without GPUs)")
    actors.add_argument("--reward-workers", type=int, default=1, metavar="N", help="reward workers on this node")
    actors.add_argument("--custom-actor", action="append", default=[], metavar="NAME=MODULE:CLASS",
                        help="run a custom actor class under role NAME; scale it with --NAME-workers")
    for name in custom_names:
        actors.add_argument(f"--{name.replace('_', '-')}-workers", type=int, default=1, dest=f"{name}_workers",
                            metavar="N", help=f"number of custom {name!r} actors on this node")
    actors.add_argument("--max-restarts", type=int, default=5, metavar="N",
                        help="crashes of one actor within --restart-window before the run fails")
    actors.add_argument("--restart-window", type=float, default=300.0, metavar="SECONDS",
                        help="the window --max-restarts counts an actor's crashes in")
    actors.add_argument("--restart-backoff", type=float, default=0.5, metavar="SECONDS",
                        help="first restart delay in seconds; it doubles per consecutive crash up to 30s")
    actors.add_argument("--fork-actors", action=argparse.BooleanOptionalAction,
                        default=sys.platform.startswith("linux"),
                        help="on a node without GPUs, fork actors from one process that imported torch and "
                             "transformers once (actors/launch/zygote.py) instead of starting each as a new "
                             "interpreter: seconds less start-up")

    run = parser.add_argument_group("run")
    run.add_argument("--run-dir", type=Path, default=None, metavar="PATH",
                     help="where logs, metrics, checkpoints and actor configs go (default runs/<timestamp>)")
    run.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                     help="what the actors write to their logs in RUN_DIR/logs")
    run.add_argument("--console-log-level", default="warning", choices=("debug", "info", "warning", "error"),
                     help="what the actors print to this terminal (their full logs are in RUN_DIR/logs)")
    run.add_argument("--no-progress", action="store_true", help="no live progress line")
    add_policy_flags(parser)
    add_config_flags(parser)
    add_help_flags(parser)
    return parser


def parse_custom_actors(argv: Sequence[str]) -> dict[str, str]:
    """First pass over argv: the custom actors decide which `--NAME-workers` flags exist."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--custom-actor", action="append", default=[])
    known, _ = pre.parse_known_args(list(argv))
    customs: dict[str, str] = {}
    for item in known.custom_actor:
        name, sep, path = item.partition("=")
        if not sep or ":" not in path:
            raise LaunchError(f"--custom-actor {item!r}: expected NAME=package.module:ClassName")
        if not CUSTOM_NAME.match(name):
            raise LaunchError(f"--custom-actor {item!r}: NAME must match {CUSTOM_NAME.pattern}")
        if name in BUILTIN_ROLES:
            raise LaunchError(f"--custom-actor {item!r}: {name!r} is a built-in role")
        customs[name] = path
    return customs


def check_head_address(address: str, *, binding: bool) -> tuple[str, int]:
    parts = urlsplit(address)
    if parts.scheme != "tcp" or not parts.hostname or parts.port is None:
        raise LaunchError(f"--head-address {address!r}: expected tcp://HOST:PORT")
    if binding:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            # As ZeroMQ binds: the port of a head that was just killed is still held by its connections in
            # TIME_WAIT, which must not stop the head from starting again; only a listener means "in use".
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((parts.hostname, parts.port))
            except OSError as error:
                raise LaunchError(f"--head-address {address}: cannot bind ({error.strerror}); is another run "
                                  f"using port {parts.port}?") from None
    return parts.hostname, parts.port


def check_curve_keys(directory: Path) -> None:
    """Load the keys every actor will load, once, before anything starts (or waits for the head): a missing, broken
    or loose key file is then one line naming the file, not a crash of every actor, restarted until the run fails."""
    try:
        CurveKeys.load(directory)
    except CurveKeyError as error:
        raise LaunchError(f"--curve-keys: {error}") from None


def wait_for_head(address: str, timeout: float) -> None:
    """Non-head nodes: fail early with a clear message instead of actors timing out one by one."""
    host, port = check_head_address(address, binding=False)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError as error:
            if time.monotonic() > deadline:
                raise LaunchError(f"head {address} unreachable after {timeout:.0f}s ({error})") from None
            time.sleep(0.5)


def custom_actor_problems(customs: dict[str, str]) -> list[str]:
    """Each custom actor class that does not load (a built-in one is known to; importing the learner's would cost
    ~1.5 s)."""
    problems = []
    for name, path in customs.items():
        try:
            resolve_actor_class(path)
        except (ImportError, AttributeError, TypeError, ValueError) as error:
            problems.append(f"--custom-actor {name}={path}: {error}")
    return problems


def place_in_job(args: argparse.Namespace) -> cluster_env.ClusterNode | None:
    """Under a scheduler, and without --head or --head-address: this node's rank, role, address and its head's,
    from the scheduler's environment; None (and --host 127.0.0.1 unless given) outside one."""
    node = None
    if not args.head and args.head_address is None:
        try:
            node = cluster_env.detect()
        except cluster_env.ClusterEnvError as error:
            raise LaunchError(str(error)) from None
    if node is None:
        args.host = args.host or "127.0.0.1"
        return None
    args.head, args.node_rank = node.is_head, node.rank
    try:
        if args.host is None:
            args.host = cluster_env.routable_address(node.own_host, node.head_host, node.head_port)
        if not node.is_head and args.rendezvous_file is None:
            args.head_address = f"tcp://{socket.gethostbyname(node.head_host)}:{node.head_port}"
    except OSError as error:
        raise LaunchError(f"{node.describe()}: cannot resolve an address ({error})") from None
    print(f"launcher.py: {node.describe()} (this node: {args.host})", file=sys.stderr)
    return node


def head_from_rendezvous(args: argparse.Namespace) -> str:
    if args.rendezvous_file is None:
        raise LaunchError("--head-address is required on a node without --head (or --rendezvous-file, or a "
                          "scheduler's environment: docs/cluster.md)")
    try:
        return cluster_env.read_rendezvous(args.rendezvous_file, cluster_env.job_key(), args.connect_timeout)
    except TimeoutError as error:
        raise LaunchError(str(error)) from None


def plan_actors(args: argparse.Namespace, customs: dict[str, str], counts: dict[str, int], head_address: str,
                run_dir: Path, config: RunConfig, other_nodes: dict[str, int] | None = None,
                ) -> tuple[list[ActorContext], RunConfig]:
    """The actors this node runs, in start order, and the config they all get: on the head, the weight transport
    is resolved here from the placement, so every actor sees the same one. `other_nodes`: the actors the other
    nodes of a scheduled job run, which the controller counts among those it expects."""
    other_nodes = other_nodes or {}
    roles = list(counts)
    try:  # engines that hold no GPU (an engine plugin's needs_gpu = False) take none, and weights over gloo
        rollout_needs_gpu = engine_needs_gpu(config.engine.rollout_engine)
    except ValueError as error:
        raise LaunchError(f"placement: {error}") from None
    trains = "learner" in roles or "learner-ranks" in roles
    engines = len(role_actors("rollout", counts.get("rollout", 0), config, run_dir, head=args.head,
                              joining=args.join_policy)
                  ) if "rollout" in roles else 0  # the run's shared ones and those of policies' own engines
    placement = place_actors(config, learner_ranks=learner_ranks_per_node(config) if trains else 0,
                             rollout_workers=engines, rollout_needs_gpu=rollout_needs_gpu)
    if args.head and config.weights.weight_transport == "auto":
        cuda = placement.gpus > 0 and rollout_needs_gpu
        # engines on other nodes cannot map this node's memory: a broadcast reaches them
        local = placement if not other_nodes.get("rollout") else None
        config = config.with_settings(weight_transport=weight_backend(
            cuda=cuda, shared=local is not None and local.shared, colocate=config.placement.colocate))
    parent_visible = os.environ.get("CUDA_VISIBLE_DEVICES")

    def devices_of(role: str, index: int) -> str | None:
        if not placement.gpus or role in customs:
            return None  # no GPU here, or a custom actor: it sees what the launcher sees
        if role in ("learner", "learner-ranks"):
            return visible_devices(placement.learner, parent_visible)
        if role == "rollout":
            return visible_devices(placement.rollout[index], parent_visible)
        return ""  # controller, buffer, reward workers: no CUDA context on anyone's GPU

    def actor_id_of(role: str, index: int, scope: Scope) -> str:
        return scope.actor_id(role if role in SINGLETON_ROLES else f"{role}-{args.node_rank}-{index}")

    # a policy's role once per policy (its settings, its own run directory), a shared one once, and the rollout
    # workers of a policy's own engines: (role, index, scope); a launcher of a policy joining the running job: that
    # policy's only
    actors = [(role, index, scope) for role in roles
              for index, scope in role_actors(role, counts[role], config, run_dir, head=args.head,
                                              joining=args.join_policy)]
    here = Counter(role for role, _, _ in actors)
    totals = {r: here.get(r, 0) + other_nodes.get(r, 0) for r in {*here, *other_nodes}}
    run_members = {r: n for r, n in totals.items() if r != "controller" and n > 0}
    cores = usable_cores()
    actor_roles = {actor_id_of(role, index, scope): role for role, index, scope in actors}
    budget = {} if config.placement.cpu_budget == "off" else plan_cpu_budget(
        cores=cores, roles=actor_roles, gpus=placement.gpus, learner_ranks=config.trainer.learner_ranks,
        synchronous=all(scope.config.buffer.max_staleness == 0 for role, _, scope in actors if role == "learner"))
    contexts, ordinal = [], Counter[str]()  # ordinal: an actor's place among the node's of its role (its devices)
    for role, index, scope in actors:
        actor_id = actor_id_of(role, index, scope)
        ordinal[role] += 1
        share = budget.get(actor_id, CpuShare())
        expected = run_members if role == "controller" else {}
        settings = ActorSettings(log_level=args.log_level, console_log_level=args.console_log_level,
                                 run=scope.config, expected_roles=expected, restart_backoff=args.restart_backoff)
        contexts.append(ActorContext(
            actor_id=actor_id, role=role, actor_class=customs.get(role) or BUILTIN_ROLES[role],
            node_rank=args.node_rank, head_address=head_address, run_dir=scope.run_dir, host=args.host,
            transport=args.transport, curve_keys_dir=args.curve_keys, heartbeat_interval=args.heartbeat_interval,
            settings=settings, cuda_visible_devices=devices_of(role, ordinal[role] - 1), cpu_cores=share.cores,
            torch_threads=share.torch_threads, policy=scope.policy,
        ))
    if placement.gpus:
        print(f"placement (node {args.node_rank}): {placement.describe()}", file=sys.stderr)
    elif budget and args.console_log_level in ("debug", "info"):
        print(describe_cpu_budget(budget, cores, actor_roles), file=sys.stderr)
    return contexts, config


def place_actors(config: RunConfig, *, learner_ranks: int, rollout_workers: int,
                 rollout_needs_gpu: bool = True) -> NodePlacement:
    try:
        return place_node(gpus=node_gpus(config), learner_ranks=learner_ranks, rollout_workers=rollout_workers,
                          gpus_per_engine=config.engine.rollout_num_gpus_per_engine,
                          rollout_engine=config.engine.rollout_engine,
                          rollout_needs_gpu=rollout_needs_gpu, colocate=config.placement.colocate)
    except PlacementError as error:
        raise LaunchError(f"placement: {error}") from None


def prepare(argv: Sequence[str]) -> tuple[list[ActorContext], argparse.Namespace, Path]:
    put_working_directory_on_path()  # the checks below import plugins as the actors, started here, will
    customs = parse_custom_actors(argv)
    remaining, sglang_passthrough = split_sglang_args(list(argv))
    args = build_parser(list(customs)).parse_args(remaining)
    args.sglang_passthrough = sglang_passthrough
    if args.curve_keys is not None:
        check_curve_keys(args.curve_keys)
    if args.leave_policy is not None:  # asks the controller, starts nothing
        ask_to_leave(args.head_address or head_from_rendezvous(args), args.leave_policy,
                     "asked by launcher.py --leave-policy", curve_keys=args.curve_keys)
        return [], args, Path()
    joining = policy_settings(args) if args.join_policy is not None else None
    node = place_in_job(args)
    if args.head:
        port = node.head_port if node is not None and args.rendezvous_file is None else free_port(args.host)
        head_address = args.head_address or f"tcp://{args.host}:{port}"
        check_head_address(head_address, binding=True)
        if args.rendezvous_file is not None:
            cluster_env.write_rendezvous(args.rendezvous_file, head_address, cluster_env.job_key())
    else:
        head_address = args.head_address or head_from_rendezvous(args)
        wait_for_head(head_address, args.connect_timeout)
    problems: list[str] = []
    try:
        head_settings = None if args.head else fetch_head_settings(
            head_address, node_rank=args.node_rank, curve_keys=args.curve_keys, timeout=args.connect_timeout)
        config = config_from_args(args, base=head_settings)
    except SettingsError as error:  # reported below, with what the file checks find in the valid settings
        problems, config = error.problems, error.usable
    except (HeadSettingsError, ValueError) as error:
        raise LaunchError(str(error)) from None
    slime = args.slime_translation
    os.environ.update(slime.env)  # inherited by every actor this launcher starts
    if slime.note():
        print(f"launcher.py: {slime.note()}", file=sys.stderr)
    other_nodes: dict[str, int] = {}
    if not problems:  # else the run stops below, after the file checks
        other_nodes = worker_node_roles(args, customs, node.nodes if node is not None and node.is_head else None,
                                        config)
        if args.head and config.placement.actor_num_nodes > 1 and config.placement.learner_world_address is None:
            # before any node asks for the settings: every node's learner ranks meet rank 0 here, at every restart
            config = config.with_settings(learner_world_address=f"tcp://{args.host}:{free_port(args.host)}")
        # after the other nodes' counts: a node given the router attaches none of its servers, the head all
        config = attach_router_servers(config, head=args.head, rollout_workers=args.rollout_workers)
    if joining is not None and not problems:
        config = with_joining_policy(config, args.join_policy, joining)
    counts = node_actor_counts(args, customs, config) if joining is None else joining_roles(config, args.join_policy)
    if config.learner.load_debug_rollout_data and args.roles is None:
        # a replay's learner reads its batches from disk: a buffer would have no prompts, and crash until the
        # launcher gave up on it (the run failed whenever the replay took longer than its restarts)
        counts.pop("buffer", None)
    problems += custom_actor_problems(customs) + preflight(config, counts)
    if problems:
        raise LaunchError(f"{len(problems)} configuration problem(s), no actor started:\n  " + "\n  ".join(problems))
    run_dir = (args.run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    if joining is not None:  # the controller adds the policy before its actors register
        ask_to_join(head_address, args.join_policy, joining, curve_keys=args.curve_keys)
    contexts, config = plan_actors(args, customs, counts, head_address, run_dir, config, other_nodes)
    if joining is None:  # a worker node beside the head's config.yaml, in a run directory the nodes share
        node_file = "config.yaml" if args.head else f"config-node{args.node_rank}.yaml"
        write_effective_config(config, run_dir, name=node_file)
    if args.head or joining is not None:
        write_policy_configs(config, run_dir, only=args.join_policy)
    return contexts, args, run_dir


async def supervise(contexts: list[ActorContext], args: argparse.Namespace, run_dir: Path,
                    early_template: EarlyTemplate | None = None, clock: RunClock | None = None) -> int:
    """Run this node's actors to the end; on the learner's node, then certify, plot and summarize the run.
    `clock`: the run's clock, which the head's launcher stops when its actors are done (the summary's wall-clock)."""
    policy = RestartPolicy(max_restarts=args.max_restarts, window_s=args.restart_window,
                           backoff_initial_s=args.restart_backoff)
    # A GPU node hands out devices (controller, buffer and reward workers get ""): never fork there.
    fork = args.fork_actors and all(context.cuda_visible_devices is None for context in contexts)
    supervisor = Supervisor(contexts, run_dir=run_dir, policy=policy, fork_from_template=fork,
                            early_template=early_template)
    loop = asyncio.get_running_loop()
    left = []  # a joining policy's launcher: whether the policy left (it leaves once, before its actors stop)

    def on_signal(signum: int) -> None:
        if args.join_policy is not None and not left and not supervisor.stopping:
            left.append(signum)
            leaving = leave_on_stop(contexts[0].head_address, args.join_policy, f"its launcher got "
                                    f"{signal.Signals(signum).name}", curve_keys=args.curve_keys)
            asyncio.ensure_future(leaving).add_done_callback(
                lambda _: supervisor.request_stop(f"signal {signal.Signals(signum).name}", signum=signum))
            return
        supervisor.request_stop(f"signal {signal.Signals(signum).name}", signum=signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal, signum)
    learners = [c for c in contexts if c.role == "learner"]  # one per policy, each in its policy's directory
    stop_progress = asyncio.Event()
    progress = None
    if learners and not args.no_progress:
        followed = [Followed(c.run_dir, c.settings.run.learner.num_rollout, policy=c.policy,
                             start=ProgressStart.of(c.run_dir, resume_step(c.settings.run, c.run_dir)))
                    for c in learners]  # before the learners write a line
        progress = asyncio.create_task(follow_learners(followed, stop_progress))
    head_watch = None
    if not args.head and args.head_loss_timeout > 0 and contexts:
        head_watch = asyncio.create_task(stop_node_when_head_lost(contexts[0], args.head_loss_timeout, supervisor))
    code = await supervisor.run()
    if args.join_policy is not None and not left:  # its training finished (or failed): it takes no more groups
        why = "its training finished" if code == 0 else f"its launcher ended (exit {code})"
        await leave_on_stop(contexts[0].head_address, args.join_policy, why, curve_keys=args.curve_keys,
                            quiet=True)
    if clock is not None:
        clock.stop()
    if head_watch is not None:
        head_watch.cancel()
    stop_progress.set()
    if progress is not None:
        await progress  # the steps of the run's last second, before what is said about its end
    if supervisor.failure is not None:  # whole, as text: a hang report spans several lines
        print(f"launcher.py: run failed: {supervisor.failure}", file=sys.stderr)
    if learners:
        from actors.buffer.accounting import prompt_verdict
        from actors.report.run_report import certify_run, report_run

        policies = [c.policy for c in learners if c.policy is not None]
        if args.head:  # every policy that took part, those that joined the running job too
            certify_run(run_dir, prompts=prompt_verdict, run_failed=supervisor.failure,
                        policies=run_dir_policies(run_dir, policies) if policies else [])
        else:  # a joining policy's launcher: the head certifies it with the run's others
            print(f"policy {args.join_policy}: the head's launcher certifies it at the run's end "
                  f"({run_dir / 'integrity.json'})", file=sys.stderr)
        if learners[0].settings.run.logging.plots:  # a shared setting
            report_run(run_dir, policies)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    from actors.runtime.logs import configure_logging
    from actors.runtime.process_title import name_process

    started = time.time()  # the run's clock starts with the command (model checks and loading are run time too)
    arguments = list(sys.argv[1:] if argv is None else argv)
    early_template = EARLY_TEMPLATE if argv is None else EarlyTemplate.for_learner(arguments)
    try:
        contexts, args, run_dir = prepare(arguments)
    except LaunchError as error:
        if early_template is not None:
            early_template.close()
        print(f"launcher.py: error: {error}", file=sys.stderr)
        return 2
    if args.leave_policy is not None:
        print(f"launcher.py: policy {args.leave_policy} left the run", file=sys.stderr)
        return 0
    name = f"launcher-{args.node_rank}" if args.join_policy is None else f"launcher-{args.join_policy}"
    name_process(name, node=args.node_rank, run_dir=run_dir)
    configure_logging(role="launcher", actor_id=name, node=args.node_rank,
                      log_dir=run_dir / "logs", file_level=args.log_level, console_level=args.console_log_level)
    print(f"run directory: {run_dir}  head: {contexts[0].head_address if contexts else '-'}", file=sys.stderr)
    clock = None
    if args.head:
        clock = RunClock.start(run_dir, now=started)
        contexts = [on_clock(context, clock) for context in contexts]
    code = asyncio.run(supervise(contexts, args, run_dir, early_template, clock))
    if code > 128 and contexts:  # stopped by a signal (Ctrl-C, SIGTERM): say where, and how to go on
        program = sys.argv[0] if argv is None else "launcher.py"
        command = resume_command(program, arguments, run_dir, run_dir_given=args.run_dir is not None)
        learners = [Scope(c.policy, c.settings.run, c.run_dir) for c in contexts if c.role == "learner"]
        print(interrupted_note(learners, code - 128, command), file=sys.stderr)
    return code


def on_clock(context: ActorContext, clock: RunClock) -> ActorContext:
    """`context` with the run's clock, which every actor's metrics are timed by (restarted ones included)."""
    settings = context.settings.model_copy(update={"clock_origin": clock.origin})
    return dataclasses.replace(context, settings=settings)


if __name__ == "__main__":
    sys.exit(main())
