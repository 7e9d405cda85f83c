"""A template process that has already imported torch and transformers, from which actors are forked.

Every actor process used to start with `python -m actors.runtime.main`, and each one that generates or trains
imported torch and transformers on its own: ~2.5 s of CPU each, five or six times over, on the same few cores,
before the first rollout. The launcher instead starts this process once (`python -m actors.launch.zygote FD`);
it imports the heavy modules and waits for orders on the socket FD. Each order forks a child that becomes one
actor (`actors.runtime.main.main([context])`), so an actor starts with the imports already done, and a crashed
actor restarts as fast.

The launcher of a head node starts it first thing, before its own imports and settings, so it is ready when
the first order comes. It still imports the heavy modules only at the first order that needs them, after the
light actors were forked: a controller or buffer forked after torch was imported would carry torch's objects in
every garbage collection of its event loop.

Orders and reports are JSON lines: `{"spawn": TAG, "context": PATH, "env": {...}, "heavy": BOOL}` (heavy: the
actor holds a model, so torch and transformers are imported first, once) is answered with
`{"spawned": TAG, "pid": PID}`; every child's end is reported as `{"exited": PID, "code": CODE}` (a negative code
for a signal, as asyncio reports it). A child runs in its own session, takes SIGTERM when this process dies, and
this process takes SIGTERM when the launcher dies, so no actor outlives the launcher.

Only for nodes without GPUs: nothing here initialises CUDA, but a module that asked whether CUDA is available at
import time would leave every forked child unable to use it, and GPU start-ups are dominated by model loading.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import selectors
import signal
import socket
import sys
from typing import Any

from actors.runtime.logs import quiet_library_output
from actors.runtime.process_title import name_process
from engines.process import die_with_parent, exit_now

# What every actor imports (the template is ready once these are in), and what only the model-holding ones do:
# imported at the first order that needs them, so the controller, buffer and reward workers start meanwhile.
LIGHT = ("numpy", "zmq", "msgspec", "structlog", "pydantic", "actors.runtime.main")
HEAVY = ("torch", "transformers", "actors.rollout.actor", "actors.rollout.engine_factory", "actors.learner.actor",
         "actors.learner.trainer_factory", "engines.inference.torch_engine", "engines.training.torch_trainer")


def preload(names: tuple[str, ...]) -> None:
    import importlib

    for name in names:
        importlib.import_module(name)
    if "transformers" in names:  # the classes models load with: most of transformers' import cost
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401


def become_actor(context_path: str, env: dict[str, str]) -> int:
    """In the forked child: a fresh session and environment, fresh random state, then the actor's own main."""
    os.setsid()
    die_with_parent()
    os.environ.clear()
    os.environ.update(env)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    random.seed()  # the template's random state is every child's otherwise
    with contextlib.suppress(ImportError):
        import numpy

        numpy.random.seed()
    from actors.runtime.main import main

    return main([context_path])


def serve(control: socket.socket) -> None:
    """Fork on each order and report every child's end, until the launcher closes the socket."""
    selector = selectors.DefaultSelector()
    wakeup_read, wakeup_write = socket.socketpair()
    wakeup_write.setblocking(False)
    signal.set_wakeup_fd(wakeup_write.fileno())
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector.register(control, selectors.EVENT_READ, "control")
    selector.register(wakeup_read, selectors.EVENT_READ, "child")
    pending = b""
    heavy_loaded = False
    while True:
        for key, _ in selector.select(timeout=1.0):
            if key.data == "child":
                with contextlib.suppress(BlockingIOError):
                    wakeup_read.recv(4096)
                continue
            try:
                data = control.recv(65536)
            except ConnectionError:  # closed with our "ready" unread: the launcher gave up on us
                data = b""
            if not data:
                return  # the launcher is gone; our children get SIGTERM from their death signal
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                order = json.loads(line)
                if order.get("heavy") and not heavy_loaded:
                    preload(HEAVY)
                    heavy_loaded = True
                pid = os.fork()
                if pid == 0:
                    code = 1
                    try:
                        signal.set_wakeup_fd(-1)
                        selector.close()
                        for inherited in (control, wakeup_read, wakeup_write):
                            inherited.close()
                        code = become_actor(order["context"], order["env"])
                    finally:
                        exit_now(code)
                _send(control, {"spawned": order["spawn"], "pid": pid})
        _report_exits(control)


def _report_exits(control: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        _send(control, {"exited": pid, "code": code})


def _send(control: socket.socket, message: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):  # the launcher is gone: nothing to tell
        control.sendall(json.dumps(message).encode() + b"\n")


def main() -> None:
    control = socket.socket(fileno=int(sys.argv[1]))
    name_process("actor-template")  # each forked actor renames itself before it runs
    quiet_library_output()  # torch and transformers read it when imported here, for every actor forked later
    preload(LIGHT)
    _send(control, {"ready": os.getpid()})
    serve(control)
    # The launcher is done with us and we hold nothing to clean up: an ordinary interpreter exit would finalize the
    # torch and transformers modules imported for the actors, seconds that the end of every run waited for.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
