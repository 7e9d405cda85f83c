"""Entry point of one actor process: `python -m actors.runtime.main CONTEXT.json`.

The launcher starts every actor this way; a developer can start one by hand with the same file to debug it.
The process runs on uvloop where available, turns SIGTERM/SIGINT into a graceful stop, and a second signal
into an immediate exit. Its exit code tells the launcher what happened (actors.runtime.exits): 0 stopped on
purpose, 1 crashed, 2 bad configuration (a `ConfigError`, a plugin path that does not load, an unreadable context:
reported with its reason, and not restarted), 3 controller unreachable.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import os
import signal
import sys
from pathlib import Path

import structlog

from actors.config import CONFIG_ERRORS
from actors.runtime import chaos
from actors.runtime.context import ActorContext
from actors.runtime.exits import EXIT_BAD_CONFIG, report_bad_config
from actors.runtime.logs import configure_logging, quiet_library_output, route_python_warnings
from actors.runtime.process_title import name_process
from actors.runtime.roles import resolve_actor_class
from engines.process import exit_now


def _install_signal_handlers(actor: object) -> None:
    loop = asyncio.get_running_loop()
    signals_seen = {"count": 0}

    def on_signal(signum: int) -> None:
        signals_seen["count"] += 1
        if signals_seen["count"] > 1:
            os._exit(128 + signum)
        actor.request_stop(f"signal {signal.Signals(signum).name}")  # type: ignore[attr-defined]

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)


async def _serve(context: ActorContext) -> int:
    actor_class = resolve_actor_class(context.actor_class)
    actor = actor_class(context)
    _install_signal_handlers(actor)
    return await actor.main()


def run_actor(context: ActorContext) -> int:
    name_process(context.actor_id, node=context.node_rank, run_dir=context.run_dir)
    if context.cuda_visible_devices is not None:  # before anything initialises CUDA in this process
        os.environ["CUDA_VISIBLE_DEVICES"] = context.cuda_visible_devices
    # `kill -USR1 PID` prints every thread's stack to the actor's stderr: the first tool for a stuck actor.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        chaos.arm(context.actor_id, context.role, context.run_dir)  # the chaos matrix's kill points, if any
    except chaos.KillPlanError as error:
        print(f"{context.actor_id}: bad configuration: {error}", file=sys.stderr)
        return report_bad_config(context, str(error))
    configure_logging(role=context.role, actor_id=context.actor_id, node=context.node_rank,
                      log_dir=context.log_dir, file_level=context.settings.log_level,
                      console_level=context.settings.console_log_level)
    route_python_warnings()
    run = asyncio.run
    with contextlib.suppress(ImportError):
        import uvloop

        run = uvloop.run
    try:
        return run(_serve(context))
    except CONFIG_ERRORS as error:
        structlog.get_logger().error("bad configuration", error=str(error))
        return report_bad_config(context, str(error))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    quiet_library_output()  # before the actor's module imports torch and transformers
    if len(args) != 1:
        print("usage: python -m actors.runtime.main CONTEXT.json", file=sys.stderr)
        return 2
    path = Path(args[0])
    try:
        context = ActorContext.from_json(path.read_text(encoding="utf-8"), source=str(path))
    except (OSError, ValueError, TypeError) as error:
        print(f"actor context {path}: {error}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    try:
        resolve_actor_class(context.actor_class)
    except (ValueError, TypeError, ImportError, AttributeError) as error:
        print(f"{context.actor_id}: bad configuration: {error}", file=sys.stderr)
        return report_bad_config(context, str(error))
    return run_actor(context)


if __name__ == "__main__":
    exit_now(main())  # the launcher waits for the process to end, not for torch's modules to be torn down
