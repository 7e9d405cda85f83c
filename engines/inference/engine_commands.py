"""How the torch engine's async side and its decode thread talk: a command, and the reply that answers it.

A command is queued by a coroutine on the caller's event loop and applied by the decode thread between two
steps (`TorchEngine._apply_commands`; the commands themselves live beside the engine state they change). Its
reply is an asyncio future of the caller's loop, resolved from the decode thread through `call_soon_threadsafe`.
A generate command is answered later, when its samples finish (`DEFERRED`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engines.inference.decoding_sequence import DecodingSequence


@dataclass
class Reply:
    """An asyncio future owned by the caller's loop, resolved from the decode thread."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future

    def succeed(self, value: object) -> None:
        self._post(_set_result, value)

    def fail(self, exc: BaseException) -> None:
        self._post(_set_exception, exc)

    def _post(self, setter: Callable[[asyncio.Future, Any], None], value: object) -> None:
        # A closed caller loop raises RuntimeError: nobody is waiting any more, so there is nothing to tell.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(setter, self.future, value)


def _set_result(future: asyncio.Future, value: object) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


@dataclass
class Pending:
    reply: Reply
    samples: list[DecodingSequence]


@dataclass
class Command:
    reply: Reply | None = field(default=None, init=False)

    def apply(self, engine: Any) -> object:
        """Run on the decode thread, given the engine; return the reply's value (or DEFERRED)."""
        raise NotImplementedError

    def succeed(self, result: object) -> None:
        if self.reply is not None and result is not DEFERRED:
            self.reply.succeed(result)

    def fail(self, exc: BaseException) -> None:
        if self.reply is not None:
            self.reply.fail(exc)


DEFERRED = object()  # a generate command is answered later, when its samples finish
