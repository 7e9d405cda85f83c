"""Structured logs for one actor process: JSON lines in the run directory, readable lines on the console.

Every record carries role, actor id, node and pid, so the merged logs of a many-process run can be filtered
per actor without guessing which process printed what. Every actor of a node shares the launcher's terminal, so
each console record goes out in one write (lines of two actors never splice), and what libraries would print on
their own (Hugging Face progress bars, c10d's C++ warnings with their stack traces) is turned off before they load.
Python warnings become records too (`route_python_warnings`): an installed library's at info level, kept in the
log file but off the console by default, since its user can do nothing about them; the rest at warning.
"""

from __future__ import annotations

import logging
import os
import sys
import sysconfig
import threading
import warnings
from pathlib import Path
from typing import Any, TextIO

import structlog

_json_file: TextIO | None = None

# Set where not already set, so a developer can still ask for any of it (`HF_HUB_DISABLE_PROGRESS_BARS=0`,
# `TORCH_CPP_LOG_LEVEL=WARNING`).
QUIET_ENV = {
    # "Loading weights", "Writing model shards" and download bars: transformers and huggingface_hub read this
    # when they are imported.
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    # c10d logs a lost peer as a WARNING with the whole C++ stack trace (TCPStore: "Exception raised from
    # recvBytes ... frame #0 ..."); the Python exception still says what failed. Read when torch is imported.
    "TORCH_CPP_LOG_LEVEL": "ERROR",
    "TORCH_SHOW_CPP_STACKTRACES": "0",
}


def quiet_library_output() -> None:
    """Silence what libraries print to the console by themselves, in this process and the ones it starts.

    Call before torch or transformers is imported (both read the environment then); a library already imported
    (a forked actor's template, a tool that imported it at the top) is told directly where it has a switch.
    """
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    if os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] != "1":
        return
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()


class WholeLineWriter:
    """A structlog logger that writes each record, newline included, with one `os.write` on the stream's file.

    `print()` writes a message and its newline separately (two writes when unbuffered, as actors run), so another
    process sharing the terminal could land between them; one write of up to PIPE_BUF (4 KiB) bytes reaches a
    pipe whole, and a terminal gets each write in one piece. A stream without a file (a test's capture) is
    written the ordinary way.
    """

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._lock = threading.Lock()  # threads of this process: one record at a time, in order

    def msg(self, message: str) -> None:
        text = message + "\n"
        with self._lock:
            try:
                fd = self._stream.fileno()
            except (AttributeError, OSError, ValueError):
                self._stream.write(text)
                self._stream.flush()
                return
            self._stream.flush()  # what print() left in the stream's buffer goes first, keeping the order
            data = text.encode(self._stream.encoding or "utf-8", errors="backslashreplace")
            while data:
                data = data[os.write(fd, data):]

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


def _tee_to_json_file(_logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    if _json_file is not None:
        _json_file.write(structlog.processors.JSONRenderer()(None, "", dict(event_dict)) + "\n")
        _json_file.flush()
    return event_dict


def _console_filter(minimum: int) -> Any:
    def drop_below(_logger: Any, method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
        if _LEVELS.get(method, logging.INFO) < minimum:
            raise structlog.DropEvent
        return event_dict

    return drop_below


_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "warn": logging.WARNING,
           "error": logging.ERROR, "exception": logging.ERROR, "critical": logging.CRITICAL}


def configure_logging(
    *, role: str, actor_id: str, node: int, log_dir: Path | None, file_level: str = "info",
    console_level: str = "info",
) -> Any:
    """Configure structlog for this process and return a logger bound with the actor's identity.

    The JSON file gets everything at `file_level` and above; the console only `console_level` and above, so a
    many-actor run keeps the terminal for warnings and the progress line.
    """
    global _json_file
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        _json_file = open(log_dir / f"{actor_id}.jsonl", "a", buffering=1, encoding="utf-8")  # noqa: SIM115
    file_minimum = _LEVELS[file_level.lower()]
    console_minimum = _LEVELS[console_level.lower()]
    level = min(file_minimum, console_minimum) if _json_file is not None else console_minimum
    console = WholeLineWriter(sys.stderr)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            _tee_to_json_file,
            _console_filter(console_minimum),
            structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty(),
                                          exception_formatter=structlog.dev.plain_traceback),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=lambda *_: console,
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(role=role, actor_id=actor_id, node=node, pid=os.getpid())
    return structlog.get_logger()


# Files whose warnings are a library's although they are ours: megatron's CPU path forwards every torch call that
# megatron makes through this module's torch-function mode, so Python attributes megatron's warnings to it.
_PASS_THROUGH_FILES = (str(Path(__file__).resolve().parents[2] / "engines" / "megatron" / "cpu_compat.py"),)


def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple(sorted({os.path.join(os.path.realpath(paths[key]), "") for key in ("purelib", "platlib")}))


def is_library_file(filename: str) -> bool:
    """Is this source file part of an installed package (site-packages), or forwards one's calls?"""
    path = os.path.realpath(filename)
    return path.startswith(_library_dirs()) or path in _PASS_THROUGH_FILES


def route_python_warnings() -> None:
    """Send this process's Python warnings to its structured log instead of raw lines on the shared terminal.

    megatron alone prints some twenty lines at start-up (Transformer Engine and apex missing, torch.distributed
    calls torch has deprecated, its own optimizer touching a non-leaf `.grad`). Python's filters still decide
    which warnings are shown (each location once, by default); this decides where: a library's at info (the log
    file), any other (our code, a user's plugin) at warning, on the console as well.
    """

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
             line: str | None = None) -> None:
        log = structlog.get_logger()
        emit = log.info if is_library_file(filename) else log.warning
        emit("python warning", category=category.__name__, message=str(message), where=f"{filename}:{lineno}")

    warnings.showwarning = show
