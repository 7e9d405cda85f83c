"""The SGLang-compatible stand-in server (`tools.standins.sglang_server`) in a worker forked from a benchmark's
process: a process of its own, as `ServerProcess` starts it, without a new interpreter importing torch,
transformers and the engine again (tools/bench/forked.py).

The worker is forked when the benchmark makes it, before the benchmark's first torch op, and waits for one JSON line
on its stdin: the server's arguments. `start` sends them and waits for the server's health check.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tools.bench.forked import ForkedWorker

MODULE = "tools.standins.sglang_server"


class ForkedServer:
    """`start(model, extra)` -> its URL; `stop()`. `files`: its errors file (.err) and log (.log) are named from it."""

    def __init__(self, files: Path) -> None:
        self.errors, self.log = files.with_suffix(".err"), files.with_suffix(".log")
        self.worker = ForkedWorker(lambda: _serve(json.loads(sys.stdin.readline())), self.errors)
        self.url = ""

    def start(self, model_path: Path, extra: Mapping[str, str | list[str]], timeout_s: float = 300) -> str:
        from bus.address import free_port
        from engines.sglang.launch import HEALTH_PATHS, ServerSpec, probe

        spec = ServerSpec(model_path=str(model_path), module=MODULE, extra=extra)
        port = free_port(spec.host)
        self.worker.stdin.write(json.dumps({"argv": spec.command(port)[3:], "log": str(self.log)}) + "\n")
        self.worker.close_stdin()  # its arguments, after `python -m MODULE`
        self.url = f"http://{spec.host}:{port}"
        deadline = time.monotonic() + timeout_s
        while not any(probe(self.url + path, timeout=5.0) for path in HEALTH_PATHS):
            if self.worker.poll() is not None or time.monotonic() > deadline:
                self.kill()
                log = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
                raise RuntimeError(f"the SGLang-compatible server at {self.url} did not come up (exit "
                                   f"{self.worker.returncode}):\n{self.errors.read_text()[-3000:]}{log}")
            time.sleep(0.1)
        return self.url

    def stop(self, grace_s: float = 30) -> None:
        """SIGTERM, which the server answers by closing its engine and groups; SIGKILL past `grace_s`."""
        if self.worker.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.worker.pid, signal.SIGTERM)
            try:
                self.worker.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        self.worker.kill()


def _serve(order: dict[str, Any]) -> None:
    """The server's own `main`, its output into its log, as a server process of its own has."""
    log = os.open(order["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for fd in (1, 2):
        os.dup2(log, fd)
    os.close(log)
    from tools.standins.sglang_server.server import main

    main(order["argv"])
