"""The launcher's side of `actors.launch.zygote`: start the template once, fork actors from it.

`ForkedProcess` offers what the supervisor uses of an `asyncio.subprocess.Process` (pid, returncode, wait,
send_signal, kill), so supervision, restarts and the ordered stop are the same whichever way an actor started.
Every wait has a deadline: a template that does not come up, or does not answer an order, is an error that
names it, and the supervisor then starts actors the ordinary way.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from engines.devices import gpu_device_nodes
from engines.process import die_with_parent

READY_TIMEOUT_S = 120.0  # importing torch and transformers on a loaded machine
SPAWN_TIMEOUT_S = 120.0  # the first order for a model-holding actor waits for torch and transformers to import


# glibc raises its mmap threshold (up to 32 MiB) as large blocks are freed and keeps the blocks below it in a heap
# that stays resident, holes and all: a context-parallel rank's step on a 16k row fragmented it to twice what its
# tensors needed, and four such ranks ran out of memory. Fixed at 8 MiB, that row peaks at 839 MiB a rank (a 64 KiB
# threshold: 806), and `make demo` runs as fast as with glibc's own (137 s against 131-141 s); a smaller one maps
# fresh pages for every block and costs minutes of system time (docs/long-context.md).
ACTOR_MMAP_THRESHOLD = 8 << 20


def actor_environment(cuda_visible_devices: str | None = None) -> dict[str, str]:
    """The environment an actor process starts in, forked from the template or not: ours, with output unbuffered
    (an actor's lines reach the launcher's console as they are written, not when it exits) and glibc's mmap
    threshold fixed (`ACTOR_MMAP_THRESHOLD`), each unless the user chose otherwise, and only the GPUs its placement
    gave it. Here, not in the supervisor: the launcher starts the template before it imports anything else."""
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(ACTOR_MMAP_THRESHOLD))
    if cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
    return env


class ZygoteError(RuntimeError):
    """The template process failed to start, died, or did not answer in time."""


class ForkedProcess:
    """An actor forked by the template: it is the template's child, which reports its end to us."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._ended = asyncio.Event()

    async def wait(self) -> int:
        await self._ended.wait()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is not None:  # ended: its pid may belong to someone else by now
            raise ProcessLookupError(self.pid)
        os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def ended(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._ended.set()


class EarlyTemplate:
    """A template started before the launcher's event loop: the launcher of a head node, or of a policy joining the
    running job, starts it first thing, so its start and light imports run beside the launcher's own. `Zygote.start`
    adopts it; `close` ends one that will not be used."""

    def __init__(self, env: dict[str, str]) -> None:
        self.socket, theirs = socket.socketpair()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "actors.launch.zygote", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), start_new_session=True, preexec_fn=die_with_parent, env=env)
        finally:
            theirs.close()

    @classmethod
    def for_learner(cls, argv: Sequence[str]) -> EarlyTemplate | None:
        """Started, by a launcher that always runs a learner (a head node's, or that of a policy joining the running
        job) and will fork its actors; `argv` are the launcher's. A node with GPU devices never forks (and is not
        asked here whether it has any)."""
        chosen = "--no-fork-actors" in argv or "--roles" in argv  # --roles: maybe no actor that holds a model
        learner = "--head" in argv or "--join-policy" in argv
        if not learner or chosen or not sys.platform.startswith("linux") or gpu_device_nodes():
            return None
        try:
            return cls(actor_environment())
        except OSError:
            return None  # the supervisor starts one later, or starts actors the ordinary way

    @property
    def pid(self) -> int:
        return self.process.pid

    async def wait(self) -> int:
        return await asyncio.to_thread(self.process.wait)

    def kill(self) -> None:
        self.process.kill()

    def close(self) -> None:
        """Not adopted: it has forked nothing, so it is killed, not asked (it may be inside a long import)."""
        self.socket.close()
        self.process.kill()
        self.process.wait()


class Zygote:
    def __init__(self, process: asyncio.subprocess.Process | EarlyTemplate, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.process = process
        self.reader = reader
        self.writer = writer
        self.children: dict[int, ForkedProcess] = {}
        self.early_exits: dict[int, int] = {}
        self.spawns: dict[int, asyncio.Future[int]] = {}
        self.tags = itertools.count(1)
        self.alive = True
        self.listener: asyncio.Task[None] | None = None

    @classmethod
    async def start(cls, env: dict[str, str], early: EarlyTemplate | None = None) -> Zygote:
        """Start the template, or adopt the one started `early`."""
        process: asyncio.subprocess.Process | EarlyTemplate
        if early is not None:
            process, ours = early, early.socket
        else:
            ours, theirs = socket.socketpair()
            try:
                process = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "actors.launch.zygote", str(theirs.fileno()),
                    pass_fds=(theirs.fileno(),), start_new_session=True, preexec_fn=die_with_parent, env=env)
            finally:
                theirs.close()
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        zygote = cls(process, reader, writer)
        try:
            first = await asyncio.wait_for(reader.readline(), READY_TIMEOUT_S)
        except asyncio.TimeoutError:
            await zygote.close()
            raise ZygoteError(f"the actor template (pid {process.pid}) did not finish importing within "
                              f"{READY_TIMEOUT_S:.0f}s") from None
        if not first:
            await zygote.close()
            raise ZygoteError(f"the actor template (pid {process.pid}) exited while importing (see the console)")
        zygote.listener = asyncio.create_task(zygote._listen())
        return zygote

    async def spawn(self, context_path: str, env: dict[str, str], *, heavy: bool) -> ForkedProcess:
        """Fork one actor; `heavy`: it loads models, so the template imports torch and transformers first."""
        if not self.alive:
            raise ZygoteError("the actor template is gone")
        tag = next(self.tags)
        answer: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.spawns[tag] = answer
        order = {"spawn": tag, "context": context_path, "env": env, "heavy": heavy}
        self.writer.write(json.dumps(order).encode() + b"\n")
        await self.writer.drain()
        try:
            pid = await asyncio.wait_for(answer, SPAWN_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise ZygoteError(f"the actor template did not fork {context_path} within "
                              f"{SPAWN_TIMEOUT_S:.0f}s") from None
        finally:
            self.spawns.pop(tag, None)
        child = ForkedProcess(pid)
        self.children[pid] = child
        if pid in self.early_exits:
            child.ended(self.early_exits.pop(pid))
        return child

    async def _listen(self) -> None:
        while line := await self.reader.readline():
            message: dict[str, Any] = json.loads(line)
            if "spawned" in message:
                answer = self.spawns.get(message["spawned"])
                if answer is not None and not answer.done():
                    answer.set_result(int(message["pid"]))
            elif "exited" in message:
                pid, code = int(message["exited"]), int(message["code"])
                if pid in self.children:
                    self.children.pop(pid).ended(code)
                else:
                    self.early_exits[pid] = code
        self._gone()

    def _gone(self) -> None:
        """The template died: its children took SIGTERM with it, and no one will report their ends."""
        self.alive = False
        for answer in self.spawns.values():
            if not answer.done():
                answer.set_exception(ZygoteError("the actor template died"))
        for child in self.children.values():
            child.ended(-signal.SIGTERM)
        self.children.clear()

    async def close(self) -> None:
        """After every actor ended: closing the socket ends the template."""
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()
        try:
            await asyncio.wait_for(self.process.wait(), 10.0)
        except asyncio.TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            await self.process.wait()
        if self.listener is not None:
            self.listener.cancel()
