"""Tool calls in a model's turn, Hermes/Qwen style: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
blocks after (or between) free text.

A malformed call is not an exception: the model wrote it, so it gets an error back as that call's tool result and
can try again, and the sample trains on its mistake like on anything else it wrote.

A chat template that leaves a request's `tools` out (SmolLM2's) would hide them from the model;
`actors.data.tool_prompts.describe_tools` states them in a system message in the format this parser reads back, so
what the model is told and what is read back agree.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    call_id: str  # a prefix (the session's: sample and turn) and the position in the turn: results are matched by it


@dataclass(frozen=True)
class MalformedCall:
    text: str  # what the model wrote inside the block
    error: str  # why it is not a call, in words the model can act on
    call_id: str


@dataclass(frozen=True)
class ParsedTurn:
    content: str  # the text outside the call blocks, stripped
    calls: list[ToolCall] = field(default_factory=list)
    malformed: list[MalformedCall] = field(default_factory=list)


def parse_tool_calls(text: str, *, id_prefix: str = "call_") -> ParsedTurn:
    """The calls of one model turn, in order; a block left open at the end (the model ran out of tokens, or the
    engine stopped on the closing tag before it was written) counts as a block. Call ids are `id_prefix` and the
    call's position; a session passes a prefix of its own per turn, so ids never repeat within a run."""
    calls: list[ToolCall] = []
    malformed: list[MalformedCall] = []
    for index, match in enumerate(_BLOCK.finditer(text)):
        call_id = f"{id_prefix}{index}"
        body = match.group(1).strip()
        parsed = _call(body)
        if isinstance(parsed, str):
            malformed.append(MalformedCall(body, parsed, call_id))
        else:
            calls.append(ToolCall(parsed[0], parsed[1], call_id))
    content = _BLOCK.sub("", text).strip()
    return ParsedTurn(content, calls, malformed)


def _call(body: str) -> tuple[str, dict[str, Any]] | str:
    try:
        decoded = json.loads(body)
    except json.JSONDecodeError as error:
        return f"the tool call is not valid JSON ({error.msg} at character {error.pos})"
    if not isinstance(decoded, dict) or not isinstance(decoded.get("name"), str) or not decoded["name"]:
        return 'the tool call needs a JSON object with a "name" string and an "arguments" object'
    arguments = decoded.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return f'the "arguments" of tool {decoded["name"]!r} are a string that is not JSON'
    if not isinstance(arguments, dict):
        return f'the "arguments" of tool {decoded["name"]!r} must be a JSON object, not {type(arguments).__name__}'
    return decoded["name"], arguments


def tool_names(tools: Sequence[Mapping[str, Any]]) -> set[str]:
    """The function names a request declares, from OpenAI function schemas (`{"type": "function", "function":
    {"name": ...}}`) or flat ones (`{"name": ...}`)."""
    names = set()
    for tool in tools:
        function = tool.get("function", tool)
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            names.add(function["name"])
    return names
