"""OpenAI Responses (`POST /v1/responses`) on a session, for the harnesses that speak only it (Codex-style ones).

A request becomes the internal conversation: `instructions` the system message, `input` (a string, or items:
messages with text parts, `function_call` items, `function_call_output` items) the messages after it, function
`tools` the OpenAI function schemas the chat template takes. A `function_call` joins the assistant message before
it, as one model turn is one assistant message with its calls; a `function_call_output` is a tool message.

`previous_response_id` continues a response of this session: the adapter keeps each response's conversation (the
whole of it, answer included), so a client that sends only the new items (the tool outputs, a user's reply) goes on
from there. With it, `instructions` and `tools` left out mean those of that conversation: they are in the prompt
the model saw and cannot be taken back; given, they must be the same. Without it, `input` is the whole
conversation, as a client that keeps its own state (`store: false`) sends it.

The answer is a `response` object: a `message` item with the model's text (when it wrote any, or made no call)
and a `function_call` item per call, `status` "completed", or "incomplete" with `incomplete_details` when
`max_output_tokens` (or the run's response length) cut it. `stream: true` sends Responses' events, numbered:
response.created, response.in_progress, per item output_item.added, its text or arguments as one delta and done,
output_item.done, and response.completed (response.incomplete when cut).

Refused, naming the field: tools other than functions, `tool_choice` other than "auto" (the policy samples its
own turn; nothing forces a call), a `text.format` other than plain text, `background`, `conversation`, stored
prompts, input items that are not text (images, files) or that this endpoint never produced (reasoning, item
references).
"""

from __future__ import annotations

import json
import secrets
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from actors.rollout.api_common import Events, Reply, RequestError, complete, function_tools, positive_int, text_of
from actors.rollout.chat_session import ChatSession, Completion

INPUT_TEXT_PARTS = ("input_text", "output_text", "text")
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


@dataclass(frozen=True)
class Stored:
    """A response's conversation, as the internal messages: what `previous_response_id` continues."""

    messages: list[dict[str, Any]]
    origins: list[str]  # what each message came from, in the words of this API (for a divergence error)
    instructions: str | None
    tools: list[dict[str, Any]] | None


class Responses:
    def __init__(self, model: str) -> None:
        self.model = model
        # Per session: response id -> its conversation. Weak, so a session's responses go when its episode ends.
        self.stored: weakref.WeakKeyDictionary[ChatSession, dict[str, Stored]] = weakref.WeakKeyDictionary()

    async def create(self, session: ChatSession, body: dict[str, Any]) -> Reply:
        _refuse_unserved(body)
        previous = self._previous(session, body.get("previous_response_id"))
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise RequestError(f"'instructions' must be a string, got {type(instructions).__name__}")
        tools = function_tools(body.get("tools"), _function)
        if previous is not None:
            instructions = previous.instructions if instructions is None else instructions
            tools = previous.tools if "tools" not in body else tools
        messages, origins = _conversation(previous, instructions)
        new, new_origins = _input_messages(body.get("input"))
        messages, origins = messages + new, origins + new_origins
        completion = await complete(session, messages, origins, tools=tools,
                                    max_tokens=positive_int(body, "max_output_tokens"))
        response = self._response(body, completion, instructions, tools)
        self.stored.setdefault(session, {})[response["id"]] = Stored(
            session.messages, [*origins, f"the answer of response {response['id']}"], instructions, tools)
        return _events(response) if body.get("stream") else response

    def _previous(self, session: ChatSession, response_id: Any) -> Stored | None:
        if response_id is None:
            return None
        stored = self.stored.get(session, {})
        if not isinstance(response_id, str) or response_id not in stored:
            raise RequestError(f"'previous_response_id' {response_id!r} is not a response of this session (it has "
                               f"{len(stored)}): a session holds one episode's responses")
        return stored[response_id]

    def _response(self, body: dict[str, Any], completion: Completion, instructions: str | None,
                  tools: list[dict[str, Any]] | None) -> dict[str, Any]:
        if completion.finish_reason == "abort":
            raise RequestError("the rollout worker is stopping: its engine aborted this generation", 503)
        cut = completion.finish_reason == "length"
        message = completion.message
        output: list[dict[str, Any]] = []
        if message.get("content") or not message.get("tool_calls"):
            output.append({"type": "message", "id": f"msg_{secrets.token_hex(12)}", "role": "assistant",
                           "status": "incomplete" if cut else "completed",
                           "content": [{"type": "output_text", "text": message.get("content") or "",
                                        "annotations": [], "logprobs": []}]})
        for call in message.get("tool_calls") or []:
            output.append({"type": "function_call", "id": f"fc_{secrets.token_hex(12)}", "call_id": call["id"],
                           "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                           "status": "completed"})
        return {
            "id": f"resp_{secrets.token_hex(12)}", "object": "response", "created_at": int(time.time()),
            "status": "incomplete" if cut else "completed", "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "instructions": instructions, "max_output_tokens": body.get("max_output_tokens"), "model": self.model,
            "output": output, "parallel_tool_calls": True,
            "previous_response_id": body.get("previous_response_id"),
            "temperature": None, "top_p": None, "tool_choice": "auto",
            "tools": [_flat(tool) for tool in tools or []],
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "store": True,
            "metadata": body.get("metadata") or {}, "reasoning": None,
            "usage": {"input_tokens": completion.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": completion.completion_tokens,
                      "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": completion.prompt_tokens + completion.completion_tokens},
        }


def _refuse_unserved(body: Mapping[str, Any]) -> None:
    """What a Responses client may ask for that this endpoint cannot honour: refused, not silently ignored."""
    for key in ("background", "conversation", "prompt"):
        if body.get(key):
            raise RequestError(f"'{key}' is not served by this endpoint: a session is one sample's conversation, "
                               "answered in the call")
    choice = body.get("tool_choice")
    if choice not in (None, "auto"):
        raise RequestError(f"'tool_choice' {choice!r} is not served, only \"auto\": the policy samples its own turn "
                           "and nothing forces or forbids a call")
    text_format = (body.get("text") or {}).get("format") if isinstance(body.get("text"), Mapping) else None
    if text_format is not None and (not isinstance(text_format, Mapping) or text_format.get("type") != "text"):
        raise RequestError(f"'text.format' {text_format!r} is not served, only {{'type': 'text'}}: the policy's "
                           "output is not constrained to a schema")


def _function(where: str, tool: Any) -> dict[str, Any]:
    """A Responses function tool (`{"type": "function", "name", "description", "parameters"}`) as an OpenAI
    function schema."""
    if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        kind = tool.get("type") if isinstance(tool, Mapping) else type(tool).__name__
        raise RequestError(f"{where}: only function tools ({{'type': 'function', 'name': ...}}) are served, got "
                           f"{kind!r}")
    function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
    return {"type": "function", "function": function}


def _flat(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A function schema as Responses spells its tools."""
    function = schema["function"]
    return {"type": "function", "name": function["name"], "description": function.get("description"),
            "parameters": function.get("parameters"), "strict": False}


def _conversation(previous: Stored | None, instructions: str | None) -> tuple[list[dict[str, Any]], list[str]]:
    """The messages a call starts from: the continued response's conversation, its system message the call's
    `instructions` (the session refuses them if they changed), or the instructions alone."""
    if previous is None:
        return ([{"role": "system", "content": instructions}], ["instructions"]) if instructions is not None \
            else ([], [])
    messages, origins = [dict(m) for m in previous.messages], list(previous.origins)
    if previous.instructions is not None and instructions is not None:
        messages[0]["content"] = instructions
    elif instructions is not None:
        messages, origins = [{"role": "system", "content": instructions}, *messages], ["instructions", *origins]
    return messages, origins


def _input_messages(given: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """`input` as internal messages, each with the item it came from."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}], ["input"]
    if not isinstance(given, list) or not given:
        raise RequestError("'input' must be a string or a non-empty list of input items")
    messages: list[dict[str, Any]] = []
    origins: list[str] = []
    for index, item in enumerate(given):
        if not isinstance(item, Mapping):
            raise RequestError(f"input[{index}] must be an object, got {type(item).__name__}")
        kind = item.get("type", "message" if "role" in item else None)
        where = f"input[{index}] ({kind})"
        if kind == "message":
            role = ROLES.get(item.get("role"))
            if role is None:
                raise RequestError(f"{where}: role {item.get('role')!r} is not one of {sorted(ROLES)}")
            content = text_of(item.get("content"), where, part_types=INPUT_TEXT_PARTS)
            messages.append({"role": role, "content": content})
            origins.append(where)
        elif kind == "function_call":
            call = _call(item, where)
            if messages and messages[-1]["role"] == "assistant":  # the same model turn: its text, then its calls
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                origins.append(where)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise RequestError(f"{where}: 'call_id' must be the string id of the call it answers")
            output = text_of(item.get("output"), where, part_types=INPUT_TEXT_PARTS)
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
            origins.append(where)
        else:
            raise RequestError(f"{where}: input items of type {kind!r} are not served; send messages with text, "
                               "function_call and function_call_output items")
    return messages, origins


def _call(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    name, arguments = item.get("name"), item.get("arguments", "")
    if not isinstance(name, str) or not isinstance(item.get("call_id"), str):
        raise RequestError(f"{where}: a function_call needs a string 'name' and 'call_id'")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    return {"id": item["call_id"], "type": "function", "function": {"name": name, "arguments": arguments}}


def _events(response: dict[str, Any]) -> Events:
    """A whole response as the events Responses streams for it, numbered from 0."""
    events: list[tuple[str, dict[str, Any]]] = []

    def emit(kind: str, **fields: Any) -> None:
        events.append((kind, {"type": kind, "sequence_number": len(events), **fields}))

    opening = {**response, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    emit("response.created", response=opening)
    emit("response.in_progress", response=opening)
    for index, item in enumerate(response["output"]):
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            (part,) = item["content"]
            emit("response.output_item.added", output_index=index,
                 item={**item, "status": "in_progress", "content": []})
            emit("response.content_part.added", **where, content_index=0, part={**part, "text": ""})
            emit("response.output_text.delta", **where, content_index=0, delta=part["text"], logprobs=[])
            emit("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[])
            emit("response.content_part.done", **where, content_index=0, part=part)
        else:
            emit("response.output_item.added", output_index=index,
                 item={**item, "status": "in_progress", "arguments": ""})
            emit("response.function_call_arguments.delta", **where, delta=item["arguments"])
            emit("response.function_call_arguments.done", **where, name=item["name"], arguments=item["arguments"])
        emit("response.output_item.done", output_index=index, item=item)
    emit("response.completed" if response["status"] == "completed" else "response.incomplete", response=response)
    return Events(list(events))
