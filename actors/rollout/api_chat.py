"""OpenAI Chat Completions (`POST /v1/chat/completions`, with `tools` and tool-call output) and text Completions
(`POST /v1/completions`) on a session: the messages are the internal form already, so this adapter only checks
them and shapes the answer.

`stream: true` is answered as OpenAI's chunks (content, then tool calls, then the finish reason, and the usage with
`stream_options.include_usage`), sent once the completion is done: what a rollout needs is the sample's tokens, not
an early first token.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from actors.rollout.api_common import Events, Reply, RequestError, positive_int, stop_strings
from actors.rollout.chat_session import ChatSession


class ChatCompletions:
    def __init__(self, model: str) -> None:
        self.model = model

    async def chat(self, session: ChatSession, body: dict[str, Any]) -> Reply:
        include_usage = _include_usage(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise RequestError("'messages' must be a list of objects, each with a 'role'")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise RequestError("'tools' must be a list of tool definitions")
        completion = await session.complete(messages, tools=tools or None, **_generation_options(body))
        response = {"id": f"chatcmpl-{secrets.token_hex(8)}", "object": "chat.completion",
                    "created": int(time.time()), "model": self.model,
                    "choices": [{"index": 0, "message": completion.message,
                                 "finish_reason": completion.finish_reason, "logprobs": None}],
                    "usage": _usage(completion.prompt_tokens, completion.completion_tokens)}
        return _chunks(response, include_usage) if body.get("stream") else response

    async def text(self, session: ChatSession, body: dict[str, Any]) -> Reply:
        include_usage = _include_usage(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise RequestError("'prompt' must be one non-empty string (a session is one sample)")
        text, finish, prompt_tokens, completion_tokens = await session.complete_text(prompt,
                                                                                     **_generation_options(body))
        response = {"id": f"cmpl-{secrets.token_hex(8)}", "object": "text_completion", "created": int(time.time()),
                    "model": self.model,
                    "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
                    "usage": _usage(prompt_tokens, completion_tokens)}
        return _chunks(response, include_usage) if body.get("stream") else response


def _generation_options(body: dict[str, Any]) -> dict[str, Any]:
    """What a client may set: how many tokens and where to stop. Sampling itself is the run's."""
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return {"max_tokens": positive_int(body, key), "stop": stop_strings(body, "stop")}


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not body.get("stream"):
        raise RequestError("'stream_options' is only allowed with 'stream': true")
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise RequestError(f"'stream_options' must be an object with a boolean 'include_usage', got {options!r}")
    return bool(options.get("include_usage", False))


def _chunks(response: dict[str, Any], include_usage: bool) -> Events:
    """A whole completion as the chunks OpenAI streams for it: the content, each tool call, the finish reason."""
    (choice,) = response["choices"]
    chat = response["object"] == "chat.completion"
    base = {key: response[key] for key in ("id", "created", "model")}
    base["object"] = "chat.completion.chunk" if chat else "text_completion"

    def chunk(fields: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return {**base, "choices": [{"index": 0, **fields, "finish_reason": finish_reason, "logprobs": None}]}

    if not chat:
        chunks = [chunk({"text": choice["text"]}), chunk({"text": ""}, choice["finish_reason"])]
    else:
        message = choice["message"]
        chunks = [chunk({"delta": {"role": "assistant", "content": message.get("content")}})]
        calls = message.get("tool_calls") or []
        if calls:
            chunks.append(chunk({"delta": {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}}))
        chunks.append(chunk({"delta": {}}, choice["finish_reason"]))
    if include_usage:
        chunks.append({**base, "choices": [], "usage": response["usage"]})
    return Events([(None, chunk) for chunk in chunks] + [(None, "[DONE]")])


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
