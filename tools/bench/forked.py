"""A benchmark worker forked from the benchmark's own process, speaking lines over its stdin and stdout.

A pass's worker that starts as a new interpreter imports torch, transformers and the engine again (~4.5 s of CPU
each on this machine's cores, for a pass that may take a tenth of that); forked from a parent that imported them
and ran no engine, it starts with them imported and a heap that no earlier pass used, as an actor forked from the
launcher's template does (actors/launch/zygote.py). The worker's stdin, stdout and stderr are its own pipes and
file, so the parent talks to it as to a `subprocess.Popen` with text pipes.

The worker never collects the parent's objects: they are frozen out of the garbage collector across the fork
(`gc.freeze`). A parent such as a test process holds whatever its earlier work left, garbage in reference cycles
included, some of it bound to threads or native state that the fork did not copy; finalising that in the worker
crashed it (a segfault inside the collector, CI50). The worker is short-lived: what it inherited it leaves alone.

The parent must run torch on one thread (`torch.set_num_threads(1)` before its first op): a child forked after
the parent's OpenMP pool started hangs in its first parallel region (libgomp's pool does not survive a fork). A
worker then sets its own thread count and starts a pool of its own.
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from engines.process import die_with_parent

_PARENT_ENDS: set[int] = set()  # the parent's ends of every live worker's pipes: a later worker closes them


class ForkedWorker:
    """`target()` run in a forked child; `stdin`, `stdout` (text, line by line), `wait`, `poll`, `kill`."""

    def __init__(self, target: Callable[[], None], errors: Path) -> None:
        child_in, parent_out = os.pipe()
        parent_in, child_out = os.pipe()
        error_fd = os.open(errors, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        gc.freeze()  # the parent's objects, garbage included, out of the worker's collections
        pid = os.fork()
        if pid != 0:
            gc.unfreeze()
        if pid == 0:  # the worker
            code = 1
            try:
                die_with_parent()
                for fd in (parent_out, parent_in, *_PARENT_ENDS):
                    os.close(fd)
                for source, target_fd in ((child_in, 0), (child_out, 1), (error_fd, 2)):
                    os.dup2(source, target_fd)
                    os.close(source)
                sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
                sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", line_buffering=True)
                sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", line_buffering=True)
                target()
                code = 0
            except BaseException:
                traceback.print_exc()  # into its errors file, which the parent reads back when the worker fails
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        for fd in (child_in, child_out, error_fd):
            os.close(fd)
        _PARENT_ENDS.update((parent_out, parent_in))
        self.pid = pid
        self.returncode: int | None = None
        self.stdin = os.fdopen(parent_out, "w", encoding="utf-8")
        self.stdout = os.fdopen(parent_in, "r", encoding="utf-8")

    def close_stdin(self) -> None:
        """End of its input, for a worker that reads none or all of it."""
        _PARENT_ENDS.discard(self.stdin.fileno())
        self.stdin.close()

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self._reap(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Block until it exits; past `timeout`, `subprocess.TimeoutExpired` as `Popen.wait` raises."""
        if timeout is None:
            if self.returncode is None:
                self._reap(os.waitpid(self.pid, 0)[1])
        else:
            deadline = time.monotonic() + timeout
            while self.poll() is None:  # waitpid has no timeout: poll, as Popen.wait(timeout) does
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(f"forked worker {self.pid}", timeout)
                time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            os.kill(self.pid, signal.SIGKILL)
            self.wait()

    def _reap(self, status: int) -> None:
        self.returncode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        for stream in (self.stdin, self.stdout):
            if not stream.closed:
                _PARENT_ENDS.discard(stream.fileno())
                with contextlib.suppress(OSError):  # a pipe whose other end is gone: nothing to flush into
                    stream.close()


def forked_output(target: Callable[[], None], errors: Path) -> tuple[int, str]:
    """`target()` in a forked worker that reads nothing: its exit code and all it printed."""
    worker = ForkedWorker(target, errors)
    worker.close_stdin()
    output = worker.stdout.read()
    return worker.wait(), output
