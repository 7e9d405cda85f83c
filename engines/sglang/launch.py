"""Start, health-wait, stop and restart one SGLang server process (a real `sglang.launch_server` or ours).

The server is a child in its own process group (so stopping it takes its scheduler and detokenizer
processes too) that also dies with its parent on Linux, so a rollout worker killed with SIGKILL does not leave a
GPU server behind. Its output goes to a log file whose tail is quoted when it fails to start.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from bus.address import free_port
from engines.process import die_with_parent
from engines.sglang import protocol

logger = logging.getLogger(__name__)
_SPAWNER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sglang-spawner")
HEALTH_PATHS = (protocol.HEALTH_GENERATE.path, protocol.HEALTH.path)
PORT_ATTEMPTS = 3  # starts of a server whose chosen port another process took before it bound it


class ServerStartError(RuntimeError):
    """The server exited or stayed unhealthy during start-up; the message quotes its log."""


@dataclass(frozen=True)
class ServerSpec:
    """What to start: `python -m {module} --model-path ... --host ... --port ... --tp-size ...` plus `extra`.

    `extra` holds SGLang arguments by name without dashes (`{"mem-fraction-static": "0.8"}`); the value "true"
    makes a bare switch (`--enable-metrics`), as `--sglang-NAME` without a value does on our command line.
    """

    model_path: str
    module: str = "sglang.launch_server"
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port is chosen at each start
    tp_size: int = 1
    random_seed: int | None = None
    base_gpu_id: int | None = None  # the first GPU of this server's tp_size GPUs (SGLang's --base-gpu-id)
    extra: Mapping[str, str | list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.base_gpu_id is not None and (isinstance(self.base_gpu_id, bool) or self.base_gpu_id < 0):
            raise ValueError(f"ServerSpec.base_gpu_id must be an int >= 0 or None, got {self.base_gpu_id!r}")

    def command(self, port: int) -> list[str]:
        command = [
            sys.executable,
            "-m",
            self.module,
            "--model-path",
            self.model_path,
            "--host",
            self.host,
            "--port",
            str(port),
            "--tp-size",
            str(self.tp_size),
        ]
        if self.random_seed is not None:
            command += ["--random-seed", str(self.random_seed)]
        if self.base_gpu_id is not None:
            command += ["--base-gpu-id", str(self.base_gpu_id)]
        for name, value in self.extra.items():
            flag = "--" + name.removeprefix("--")
            if value == "true":
                command.append(flag)
            else:  # a list-valued argument (`--sglang-cuda-graph-bs 1 2 4`) passes one token per value
                command += [flag, *([value] if isinstance(value, str) else value)]
        return command


class ServerProcess:
    """One server process; `start` returns once it answers a health check."""

    def __init__(
        self,
        spec: ServerSpec,
        *,
        startup_timeout: float = 600.0,
        log_dir: Path | None = None,
        env: Mapping[str, str] | None = None,
        choose_port: Callable[[str], int] = free_port,
    ) -> None:
        self.spec = spec
        self.choose_port = choose_port
        self.startup_timeout = startup_timeout
        self.log_dir = log_dir or Path(tempfile.gettempdir()) / "slipstream-sglang"
        self.env = dict(env) if env is not None else None
        self.process: subprocess.Popen[bytes] | None = None
        self.port: int | None = None
        self.log_path: Path | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("server not started")
        return f"http://{self.spec.host}:{self.port}"

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> str:
        """Start the server and wait for its health; returns its URL. Raises ServerStartError with its log tail.

        A port we chose is free when chosen, not when the server binds it, seconds later, after loading the model:
        another process of the node (a sibling server, a ZeroMQ or torch.distributed socket) can take it between.
        A server that dies of exactly that is started again on another port, a few times, before it is an error."""
        if self.alive():
            raise RuntimeError(f"server already running at {self.url}")
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                return self._start_once()
            except ServerStartError as error:
                if self.spec.port or attempt == PORT_ATTEMPTS or not _lost_its_port(str(error)):
                    raise
                logger.warning("SGLang server port %s was taken before the server bound it; starting it again on "
                               "another port", self.port)
        raise AssertionError("unreachable")

    def _start_once(self) -> str:
        self.port = self.spec.port or self.choose_port(self.spec.host)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.log_dir / f"server-{self.spec.host}-{self.port}.log"
        command = self.spec.command(self.port)
        logger.info("starting SGLang server: %s (log %s)", " ".join(command), self.log_path)
        with open(self.log_path, "ab") as log:
            # Linux sends the parent-death signal when the THREAD that forked the child exits, and restarts run in
            # short-lived executor threads (asyncio.to_thread): fork from one thread that lives as long as we do.
            self.process = _SPAWNER.submit(
                subprocess.Popen,
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent,
                env=self.env,
            ).result()
        self.starts += 1
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self.url

    def restart(self) -> str:
        self.stop()
        return self.start()

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after `grace_s`; safe to call twice."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if not self.alive():
                code = self.process.returncode if self.process is not None else None
                raise ServerStartError(
                    f"SGLang server {self.url} exited with code {code} during start-up; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if any(probe(self.url + path, timeout=5.0) for path in HEALTH_PATHS):
                logger.info("SGLang server %s is healthy", self.url)
                return
            time.sleep(0.25)
        raise ServerStartError(
            f"SGLang server {self.url} not healthy after {self.startup_timeout:g}s; "
            f"log {self.log_path}:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def _lost_its_port(start_error: str) -> bool:
    """Whether a server's start-up failure (its log tail) is a bind on a port in use: uvicorn (SGLang) and aiohttp
    (the CPU stand-in) both say "address already in use"."""
    return "address already in use" in start_error.lower()


def wait_for_attached_server(url: str, *, timeout_s: float) -> None:
    """An attached server (`--sglang-url`, or one an sglang-router lists) may still be loading when its rollout
    worker starts: the servers were started beside the run, or one is restarting. Its health is awaited up to the
    start-up deadline, as a launched server's is, instead of failing the worker at its first refused call (the
    launcher would restart it over and over while the server loads)."""
    deadline = time.monotonic() + timeout_s
    told = False
    while not any(probe(url + path, timeout=5.0) for path in HEALTH_PATHS):
        if time.monotonic() >= deadline:
            raise ConnectionError(f"--sglang-url {url}: not healthy after {timeout_s:g}s (--sglang-startup-timeout)")
        if not told:
            logger.info("waiting for the attached SGLang server %s to answer its health check", url)
            told = True
        time.sleep(0.25)


def probe(url: str, timeout: float) -> bool:
    """True if GET `url` answers 200 within `timeout`."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False
