"""What answers the model between its turns in the built-in episode loop: an environment with `reset` and `step`.

`--agent-environment-path pkg.mod:make` names a factory `make(prompt, label, metadata) -> Environment`, called once
per sample, so no state leaks between episodes. After each model turn the loop calls `step` with the turn (its text
and parsed tool calls); the environment answers with the messages the model sees next (a tool result, a user's
reply, a game's observation), optionally a reward for that turn, and whether the episode is over. Per-turn rewards
land in the sample's `metadata["turn_rewards"]`, and `--rm-type environment_return` scores a sample by their sum.

`--agent-tools-path` is the same loop over `ToolsEnvironment`: it answers the turn's `<tool_call>` blocks and ends
the episode at the first turn without one. An environment written for an actor of its own (`--custom-actor`) is
reached the same way: its `step` makes the RPC.

Nothing an environment does ends the worker: a `step` that raises or overruns `--agent-tool-timeout` comes back to
the model as a user message saying so, and is counted as a tool error.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from actors.rollout.tool_calls import ParsedTurn
from actors.rollout.tool_environment import FunctionTools, answer_calls


@dataclass(frozen=True)
class Turn:
    """One model turn as an environment sees it."""

    text: str  # what the model wrote, tool-call blocks included
    parsed: ParsedTurn
    index: int  # 0 for the first turn of the episode


@dataclass
class EnvStep:
    messages: list[dict[str, Any]] = field(default_factory=list)  # shown to the model before its next turn
    reward: float | None = None  # this turn's reward, if the environment gives per-turn rewards
    done: bool = False
    tool_calls: int = 0  # counted into the sample's metadata and the batch's multiturn/* metrics
    tool_errors: int = 0


class Environment(Protocol):
    async def reset(self) -> list[dict[str, Any]]:
        """Messages to show after the prompt before the first turn (usually none)."""

    async def step(self, turn: Turn) -> EnvStep:
        """The answer to one model turn."""


EnvironmentFactory = Callable[[Any, Any, Mapping[str, Any]], Environment]


class ToolsEnvironment:
    """Tools as an environment: every call of a turn answered (malformed ones too), done at a turn without any."""

    def __init__(self, tools: FunctionTools, *, tool_timeout: float) -> None:
        self.tools, self.tool_timeout = tools, tool_timeout

    async def reset(self) -> list[dict[str, Any]]:
        return []

    async def step(self, turn: Turn) -> EnvStep:
        calls = turn.parsed.calls
        if not (calls or turn.parsed.malformed):
            return EnvStep(done=True)
        results = await answer_calls(self.tools, turn.parsed, timeout_s=self.tool_timeout)
        return EnvStep(messages=results.messages, tool_calls=len(calls) + len(turn.parsed.malformed),
                       tool_errors=results.errors)


async def guarded_step(environment: Environment, turn: Turn, *, timeout_s: float) -> EnvStep:
    """`environment.step(turn)`, with a failure, an overrun or an answer that is not an `EnvStep` of chat messages
    turned into a message for the model (and a tool error)."""
    try:
        step = await asyncio.wait_for(environment.step(turn), timeout_s)
        if not isinstance(step, EnvStep):
            raise TypeError(f"step() returned {type(step).__name__}, not an EnvStep")
        step.messages = check_messages(step.messages, "step()'s messages")
        return step
    except TimeoutError:
        return EnvStep(messages=[_error(f"the environment did not answer within {timeout_s:g} s")], tool_errors=1)
    except Exception as error:  # the environment's failure: the model is told, the episode goes on
        return EnvStep(messages=[_error(f"the environment failed: {type(error).__name__}: {error}")],
                       tool_errors=1)


async def make_environment(factory: EnvironmentFactory, prompt: Any, label: Any,
                           metadata: Mapping[str, Any]) -> Environment:
    """The factory's environment for one episode (a factory may be async)."""
    environment = factory(prompt, label, metadata)
    if inspect.isawaitable(environment):
        environment = await environment
    return environment


def check_messages(messages: Sequence[Any], where: str) -> list[dict[str, Any]]:
    if not all(isinstance(m, Mapping) and isinstance(m.get("role"), str) for m in messages):
        raise TypeError(f"{where} must be chat messages (dicts with a 'role')")
    return [dict(m) for m in messages]


def _error(text: str) -> dict[str, Any]:
    return {"role": "user", "content": f"error: {text}"}
