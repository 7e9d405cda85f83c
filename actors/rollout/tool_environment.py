"""The tools of one episode, and how a model turn's calls become the tool messages of the next turn.

Nothing a tool does may end the episode or the worker: an unknown tool, arguments that do not fit, a tool that
raises or overruns its deadline all come back to the model as that call's result, and are counted.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from actors.rollout.tool_calls import ParsedTurn, ToolCall

ToolFunction = Callable[..., Any] | Callable[..., Awaitable[Any]]


class ToolEnvironment(Protocol):
    """What one episode may call; a fresh one per sample, so no state leaks between samples."""

    async def call(self, call: ToolCall) -> str:
        """The result of `call` as text for the model; may raise (the caller turns that into an error result)."""


class FunctionTools:
    """Tools from plain functions, sync or async, called with the call's arguments as keywords."""

    def __init__(self, tools: Mapping[str, ToolFunction]) -> None:
        self.tools = dict(tools)

    async def call(self, call: ToolCall) -> str:
        function = self.tools.get(call.name)
        if function is None:
            raise LookupError(f"unknown tool {call.name!r}; tools: {sorted(self.tools)}")
        try:
            inspect.signature(function).bind(**call.arguments)
        except TypeError as error:
            raise TypeError(f"tool {call.name!r}: {error}") from None
        result = function(**call.arguments)
        if inspect.isawaitable(result):
            result = await result
        return str(result)


@dataclass
class ToolResults:
    messages: list[dict[str, str]] = field(default_factory=list)  # role "tool", in the order of the calls
    errors: int = 0


async def answer_calls(environment: ToolEnvironment, turn: ParsedTurn, *, timeout_s: float) -> ToolResults:
    """The tool messages answering every call of `turn`, malformed ones included, in the order they were written.

    The calls run concurrently, each under `timeout_s`.
    """
    outcomes = await asyncio.gather(*(_answer(environment, call, timeout_s) for call in turn.calls))
    answers = {call.call_id: (call.name, text, failed) for call, (text, failed) in zip(turn.calls, outcomes,
                                                                                    strict=True)}
    answers |= {bad.call_id: ("", f"error: {bad.error}", True) for bad in turn.malformed}
    results = ToolResults()
    for call_id in sorted(answers, key=lambda key: int(key.rsplit("_", 1)[1])):
        name, text, failed = answers[call_id]
        results.messages.append({"role": "tool", "tool_call_id": call_id, "name": name, "content": text})
        results.errors += failed
    return results


async def _answer(environment: ToolEnvironment, call: ToolCall, timeout_s: float) -> tuple[str, bool]:
    try:
        return await asyncio.wait_for(environment.call(call), timeout_s), False
    except TimeoutError:
        return f"error: tool {call.name!r} did not answer within {timeout_s:g} s", True
    except Exception as error:  # the model sees what went wrong; the episode goes on
        return f"error: {type(error).__name__}: {error}", True
