"""A worker node's watch on its head node: when the head is gone, this node ends the run's part it holds, says so,
and points at the checkpoint the run resumes from.

The head holds the controller, the buffer and the learner: without it nothing this node generates can be used,
and its actors would otherwise wait out --hang-timeout (15 minutes by default) before failing. A crashed
controller is restarted by the head's launcher on the same port within seconds, so a head that refuses or
ignores TCP connections for --head-loss-timeout is a lost node (killed, powered off, partitioned away), not a
restart. A hung controller still accepts connections (the kernel answers for it): that one is the hang
detector's to find.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from actors.launch.supervisor import Supervisor
from actors.runtime.checkpoint_pointer import checkpoint_dir, latest_checkpoint
from actors.runtime.context import ActorContext

PROBE_INTERVAL_S = 1.0


async def watch_head(host: str, port: int, timeout_s: float, on_lost: Callable[[float, str], None], *,
                     probe_interval_s: float = PROBE_INTERVAL_S) -> None:
    """Probe the head every `probe_interval_s`; after `timeout_s` without one connection accepted, call
    `on_lost(seconds_unreachable, last_error)` once and return."""
    unreachable_since: float | None = None
    while True:
        error = await _probe(host, port, timeout_s=min(probe_interval_s * 2, max(timeout_s, 0.1)))
        now = time.monotonic()
        if error is None:
            unreachable_since = None
        else:
            unreachable_since = now if unreachable_since is None else unreachable_since
            if now - unreachable_since >= timeout_s:
                on_lost(now - unreachable_since, error)
                return
        await asyncio.sleep(probe_interval_s)


async def _probe(host: str, port: int, *, timeout_s: float) -> str | None:
    """None when the head accepted a TCP connection (closed at once: ZeroMQ drops a peer that never greets),
    else what went wrong."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except asyncio.TimeoutError:
        return f"no answer to a connection within {timeout_s:g} s"
    except OSError as error:  # asyncio words it "Connect call failed (...)": the errno says why
        return os.strerror(error.errno) if error.errno else repr(error)
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return None


async def stop_node_when_head_lost(context: ActorContext, timeout_s: float, supervisor: Supervisor) -> None:
    """Fail this worker node once its head is lost, unless its actors are already stopping (the run ended: the
    head's launcher exits before this node's actors are done leaving)."""
    head = urlsplit(context.head_address)  # tcp://HOST:PORT, checked by the launcher
    assert head.hostname is not None and head.port is not None, context.head_address
    checkpoints = checkpoint_dir(context.settings.run.learner.save, context.run_dir)

    def lost(unreachable_s: float, error: str) -> None:
        if not supervisor.stopping:
            supervisor.fail(head_lost_report(context.head_address, unreachable_s, error, checkpoints))

    await watch_head(head.hostname, head.port, timeout_s, lost)


def head_lost_report(address: str, unreachable_s: float, error: str, checkpoints: Path) -> str:
    """What a worker node says when its head is lost: which head, since when, and how the run resumes."""
    latest = latest_checkpoint(checkpoints)
    if latest is None:
        resume = (f"No checkpoint is visible at {checkpoints} from this node (it is in the head's run directory, "
                  "if the head saved one)")
    else:
        resume = f"Its last checkpoint is {latest}"
    return (f"head node lost: {address} unreachable for {unreachable_s:.0f} s ({error}); the run cannot go on "
            f"without its controller, buffer and learner, so this node stops. {resume}: start the "
            "head's launcher again with the same command and --run-dir to resume from it, then this node's.")

