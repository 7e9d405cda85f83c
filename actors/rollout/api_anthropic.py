"""Anthropic Messages (`POST /v1/messages`) on a session, for the harnesses that speak only it (Claude-Code-style
ones). The Anthropic client appends `/v1/messages` to its base URL, so an agent gives it the session URL without
`/v1` (`episode.anthropic_base_url`); it sends `x-api-key` and `anthropic-version` headers, and any key is taken.

A request becomes the internal conversation: `system` (a string or text blocks) the system message; each message's
text blocks its text (blocks joined by a blank line); an assistant message's `tool_use` blocks its tool calls (the
block's id is the call's id, its `input` the arguments); a user message's `tool_result` blocks tool messages, in
order, before the rest of its text (a result with `is_error` reads "error: ..."); `tools` (`name`, `description`,
`input_schema`) the OpenAI function schemas the chat template takes. Anthropic is stateless: every call sends the
whole conversation, and the session checks that it extends the one it holds.

The answer is a `message`: a text block (when the model wrote text, or made no call) and a `tool_use` block per
call, with `stop_reason` "tool_use", "max_tokens" (cut by `max_tokens` or the run's response length),
"stop_sequence" (with the `stop_sequence` it ended on; its text stays in the turn, as the model wrote it and as it
trains) or "end_turn". `stream: true` sends Anthropic's events: message_start, per block content_block_start, one
delta (text_delta or input_json_delta) and content_block_stop, then message_delta with the stop reason and usage,
and message_stop.

Refused, naming the field: a missing `max_tokens` (Anthropic requires it), server tools (web search, bash, text
editor: only custom tools are served), `tool_choice` other than auto (nothing forces a call), blocks that are not
text (images, documents) or that this endpoint never produced (thinking), MCP servers. `temperature`, `top_p`,
`top_k` and `thinking` are taken and not honoured: the run's sampling draws every token.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from typing import Any

from actors.rollout.api_common import (
    Events,
    Reply,
    RequestError,
    complete,
    function_tools,
    positive_int,
    stop_strings,
    text_of,
)
from actors.rollout.chat_session import ChatSession, Completion

TEXT_BLOCKS = ("text",)
BLOCK_SEPARATOR = "\n\n"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
               413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}


def anthropic_error(message: str, status: int, code: str | None = None) -> dict[str, Any]:
    """Anthropic's error body: its `type` is what the Anthropic client reads. A full context is worded as Anthropic
    words it ("prompt is too long"), which harnesses look for to compact their context."""
    if code == "context_length_exceeded":
        message = f"prompt is too long: {message}"
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


class AnthropicMessages:
    def __init__(self, model: str) -> None:
        self.model = model

    async def create(self, session: ChatSession, body: dict[str, Any]) -> Reply:
        max_tokens = positive_int(body, "max_tokens")
        if max_tokens is None:
            raise RequestError("'max_tokens' is required (the Messages API asks every request for it)")
        _refuse_unserved(body)
        stop = stop_strings(body, "stop_sequences")
        messages, origins = _conversation(body)
        tools = function_tools(body.get("tools"), _custom_tool)
        completion = await complete(session, messages, origins, tools=tools, max_tokens=max_tokens, stop=stop)
        message = self._message(completion, stop)
        return _events(message) if body.get("stream") else message

    def _message(self, completion: Completion, stop: tuple[str, ...]) -> dict[str, Any]:
        if completion.finish_reason == "abort":
            raise RequestError("the rollout worker is stopping: its engine aborted this generation", 529)
        message = completion.message
        content: list[dict[str, Any]] = []
        if message.get("content") or not message.get("tool_calls"):
            content.append({"type": "text", "text": message.get("content") or ""})
        for call in message.get("tool_calls") or []:
            content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                            "input": json.loads(call["function"]["arguments"])})
        stop_sequence = completion.matched_stop if completion.matched_stop in stop else None
        if completion.finish_reason == "length":
            reason = "max_tokens"
        elif message.get("tool_calls"):
            reason = "tool_use"
        else:
            reason = "stop_sequence" if stop_sequence is not None else "end_turn"
        return {"id": f"msg_{secrets.token_hex(12)}", "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": reason, "stop_sequence": stop_sequence,
                "usage": {"input_tokens": completion.prompt_tokens, "output_tokens": completion.completion_tokens,
                          "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}


def _refuse_unserved(body: Mapping[str, Any]) -> None:
    if body.get("mcp_servers"):
        raise RequestError("'mcp_servers' is not served: the agent calls its tools itself")
    choice = body.get("tool_choice")
    if choice is not None and (not isinstance(choice, Mapping) or choice.get("type") != "auto"):
        raise RequestError(f"'tool_choice' {choice!r} is not served, only {{'type': 'auto'}}: the policy samples its "
                           "own turn and nothing forces or forbids a call")


def _custom_tool(where: str, tool: Any) -> dict[str, Any]:
    """An Anthropic custom tool (`name`, `description`, `input_schema`) as an OpenAI function schema."""
    custom = isinstance(tool, Mapping) and tool.get("type", "custom") == "custom"
    if not custom or not isinstance(tool.get("name"), str):
        kind = tool.get("type") if isinstance(tool, Mapping) else type(tool).__name__
        raise RequestError(f"{where}: only custom tools ({{'name', 'description', 'input_schema'}}) are served, got "
                           f"{kind!r}")
    function = {"name": tool["name"]}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    function["parameters"] = tool.get("input_schema") or {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


def _conversation(body: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """`system` and `messages` as internal messages, each with what it came from."""
    messages: list[dict[str, Any]] = []
    origins: list[str] = []
    system = body.get("system")
    if system is not None:
        text = text_of(system, "system", part_types=TEXT_BLOCKS, separator=BLOCK_SEPARATOR)
        if text:
            messages.append({"role": "system", "content": text})
            origins.append("system")
    given = body.get("messages")
    if not isinstance(given, list) or not given:
        raise RequestError("'messages' must be a non-empty list of {'role', 'content'} objects")
    for index, message in enumerate(given):
        where = f"messages[{index}]"
        role = message.get("role") if isinstance(message, Mapping) else None
        if role not in ("user", "assistant"):
            raise RequestError(f"{where}: 'role' must be 'user' or 'assistant', got {role!r}")
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise RequestError(f"{where}: 'content' must be a string or a list of content blocks")
        converted = _assistant(blocks, where) if role == "assistant" else _user(blocks, where)
        messages += converted
        origins += [where] * len(converted)
    return messages, origins


def _assistant(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    texts, calls = [], []
    for index, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and isinstance(block.get("id"), str) and isinstance(block.get("name"), str):
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input") or {})}})
        else:
            raise RequestError(f"{where}, content block {index}: an assistant message holds text and tool_use "
                               f"blocks (each tool_use with an 'id' and a 'name'), got {kind!r}")
    message: dict[str, Any] = {"role": "assistant", "content": BLOCK_SEPARATOR.join(texts)}
    if calls:
        message["tool_calls"] = calls
    return [message]


def _user(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """A user message: its tool results as tool messages, then its text as one user message."""
    results, texts = [], []
    for index, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_result" and isinstance(block.get("tool_use_id"), str):
            content = block.get("content")
            text = "" if content is None else text_of(content, f"{where}, content block {index} (tool_result)",
                                                      part_types=TEXT_BLOCKS, separator=BLOCK_SEPARATOR)
            if block.get("is_error"):
                text = f"error: {text}"
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        else:
            raise RequestError(f"{where}, content block {index}: a user message holds text and tool_result blocks "
                               f"(each tool_result with a 'tool_use_id'), got {kind!r}")
    return results + ([{"role": "user", "content": BLOCK_SEPARATOR.join(texts)}] if texts else [])


def _events(message: dict[str, Any]) -> Events:
    """A whole message as the events the Messages API streams for it."""
    events: list[tuple[str | None, Any]] = []

    def emit(kind: str, **fields: Any) -> None:
        events.append((kind, {"type": kind, **fields}))

    usage = message["usage"]
    emit("message_start", message={**message, "content": [], "stop_reason": None, "stop_sequence": None,
                                   "usage": {**usage, "output_tokens": 0}})
    for index, block in enumerate(message["content"]):
        if block["type"] == "text":
            emit("content_block_start", index=index, content_block={"type": "text", "text": ""})
            emit("content_block_delta", index=index, delta={"type": "text_delta", "text": block["text"]})
        else:
            emit("content_block_start", index=index, content_block={**block, "input": {}})
            emit("content_block_delta", index=index,
                 delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
        emit("content_block_stop", index=index)
    emit("message_delta", delta={"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]},
         usage={"output_tokens": usage["output_tokens"]})
    emit("message_stop")
    return Events(events)
