"""What the endpoint's API adapters share: how a call is refused, how a streamed answer is handed to the HTTP layer,
and the checks of fields that every API spells its own way but means the same by.

An adapter (`api_chat`, `api_responses`, `api_anthropic`) turns one request body into calls of the sample's
`ChatSession` (OpenAI-shaped messages and tools, the one internal form) and the session's `Completion` back into its
API's answer: a JSON object, or `Events` when the client asked for a stream. Tokens never pass through an adapter;
what the session records is the engine's.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from actors.rollout.chat_session import ChatSession, Completion, ConversationDiverged


class RequestError(ValueError):
    """A request the endpoint cannot serve; `status` is its HTTP status, `code` a machine-readable reason."""

    def __init__(self, message: str, status: int = 400, *, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code = status, code


@dataclass(frozen=True)
class Events:
    """A streamed answer, sent as server-sent events in order: (event name or None, data). Data that is a string
    goes out as written (OpenAI's closing `[DONE]`), anything else as JSON."""

    events: list[tuple[str | None, Any]]


Reply = dict[str, Any] | Events
Serve = Callable[[ChatSession, dict[str, Any]], Awaitable[Reply]]
ErrorBody = Callable[[str, int, str | None], dict[str, Any]]


async def complete(session: ChatSession, messages: list[dict[str, Any]], origins: list[str],
                   **options: Any) -> Completion:
    """`session.complete`, with a divergence named by the request's own item (`origins[i]` is what message i came
    from: "input[2] (function_call)", "messages[1]", "instructions"): the session knows messages, the client items."""
    try:
        return await session.complete(messages, **options)
    except ConversationDiverged as error:
        if error.position is None or error.position >= len(origins):
            raise
        raise ConversationDiverged(f"{origins[error.position]}: {error}", position=error.position) from None


def openai_error(message: str, status: int, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error body, which Chat Completions and Responses clients both read."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def positive_int(body: Mapping[str, Any], key: str) -> int | None:
    """`body[key]` as a token count: absent is None, anything but a positive integer is refused naming it."""
    value = body.get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise RequestError(f"'{key}' must be a positive integer, got {value!r}")
    return value


def stop_strings(body: Mapping[str, Any], key: str) -> tuple[str, ...]:
    """`body[key]` as stop strings: absent, one string, or a list of non-empty strings."""
    stop = body.get(key) or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(f"'{key}' must be a string or a list of non-empty strings, got {stop!r}")
    return tuple(stop)


def function_tools(tools: Any, convert: Callable[[str, Any], dict[str, Any]]) -> list[dict[str, Any]] | None:
    """A request's `tools` as the OpenAI function schemas the chat template takes, each converted by
    `convert(where, tool)` (which refuses what it cannot serve, naming `where`); None when there are none."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list of tool definitions")
    return [convert(f"tools[{index}]", tool) for index, tool in enumerate(tools)] or None


def text_of(content: Any, where: str, *, part_types: tuple[str, ...], separator: str = "") -> str:
    """Text content as a string: a string, or a list of text parts of `part_types` joined by `separator`. Anything
    else (images, files, audio) is refused naming `where`: the policy reads text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}: content must be a string or a list of text parts, got {type(content).__name__}")
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in part_types or not isinstance(part.get("text"), str):
            raise RequestError(f"{where}, content part {index}: only text parts ({', '.join(part_types)}) are "
                               f"served, got {kind or type(part).__name__!r}")
        texts.append(part["text"])
    return separator.join(texts)
