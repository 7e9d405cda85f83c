"""Structured logs for one actor process: JSON lines in the run directory, readable lines on the console.

Every record carries role, actor id, node and pid, so the merged logs of a many-process run can be filtered
per actor without guessing which process printed what.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any, TextIO

import structlog

_json_file: TextIO | None = None


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
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(role=role, actor_id=actor_id, node=node, pid=os.getpid())
    return structlog.get_logger()
