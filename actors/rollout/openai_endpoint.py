"""The OpenAI-compatible endpoint a rollout worker serves while agents run: `/v1/chat/completions` (with `tools`
and tool-call output), `/v1/completions` and `/v1/models`, one session per sample.

An episode's base URL is `http://HOST:PORT/sessions/SESSION/v1`, so an unmodified OpenAI client (or any agent
framework built on one) drives exactly one sample and every call it makes is recorded into that sample's
trajectory as tokens. A session lives on one worker, so all its calls reach the same engine and reuse the prefix
it already holds.

What the endpoint refuses, it refuses as OpenAI does (an HTTP error with `{"error": {"message": ...}}`), naming the
field and what is wrong: a body that is not JSON, `n` other than 1 (a session is one sample), a conversation that
does not extend the session's, a second call while one is running, an unknown session. None of that ends the
worker; the agent sees the error and its episode decides what to do.

`stream: true` is answered as OpenAI's server-sent events (content, then tool calls, then the finish reason, and
the usage with `stream_options.include_usage`), so agent frameworks that always stream work unchanged. The chunks
are sent once the completion is done: what a rollout needs is the sample's tokens, not an early first token.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from actors.rollout.chat_session import ChatSession, ConversationDiverged
from actors.rollout.generate import NoRoomError

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class RequestError(ValueError):
    """A request the endpoint cannot serve; `status` is its HTTP status."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class OpenAIEndpoint:
    def __init__(self, *, host: str = "127.0.0.1", model: str = "policy") -> None:
        self.host, self.model = host, model
        self.port: int | None = None
        self.sessions: dict[str, ChatSession] = {}
        self.busy: set[str] = set()
        self.runner: web.AppRunner | None = None
        self.refusing = False  # the worker stops: a call now would reach an engine already aborted

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.add_routes([web.post("/sessions/{session}/v1/chat/completions", self._call(self._chat)),
                        web.post("/sessions/{session}/v1/completions", self._call(self._text)),
                        web.get("/sessions/{session}/v1/models", self._models)])
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, 0)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    def refuse_calls(self) -> None:
        """From now on every call is refused (503); the calls already running end with the engine's abort."""
        self.refusing = True

    def open(self, session: ChatSession) -> str:
        """A new session's base URL."""
        if self.port is None:
            raise RuntimeError("the OpenAI endpoint has not started")
        key = secrets.token_hex(8)
        self.sessions[key] = session
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}/sessions/{key}/v1"

    def close(self, base_url: str) -> None:
        self.sessions.pop(base_url.rstrip("/").split("/")[-2], None)

    def _call(self, handler: Callable[[ChatSession, dict[str, Any]], Awaitable[dict[str, Any]]]) -> Handler:
        """One session call: the session looked up and held for the call, every refusal an OpenAI error."""

        async def serve(request: web.Request) -> web.StreamResponse:
            key = request.match_info["session"]
            try:
                session = self.sessions.get(key)
                if session is None:
                    raise RequestError(f"no session {key!r}: it ended with its episode, or never existed", 404)
                if key in self.busy:
                    raise RequestError("a call is already running in this session: an episode is one "
                                       "conversation, its calls one after another", 409)
                body = await _json_body(request)
                include_usage = _include_usage(body)
                if self.refusing:  # checked with no await before the engine call: the abort that follows ends it
                    raise RequestError("the rollout worker is stopping; this episode is over", 503)
                self.busy.add(key)
                try:
                    response = await handler(session, body)
                finally:
                    self.busy.discard(key)
                if body.get("stream"):
                    return await _stream(request, _chunks(response, include_usage))
                return web.json_response(response)
            except RequestError as error:
                return _error(str(error), error.status)
            except NoRoomError as error:
                return _error(str(error), 400, code="context_length_exceeded")
            except (ConversationDiverged, ValueError) as error:  # the conversation's fault, not ours
                return _error(str(error), 400)

        return serve

    async def _chat(self, session: ChatSession, body: dict[str, Any]) -> dict[str, Any]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise RequestError("'messages' must be a list of objects, each with a 'role'")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise RequestError("'tools' must be a list of tool definitions")
        completion = await session.complete(messages, tools=tools or None, **_generation_options(body))
        return {"id": f"chatcmpl-{secrets.token_hex(8)}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model,
                "choices": [{"index": 0, "message": completion.message, "finish_reason": completion.finish_reason,
                             "logprobs": None}],
                "usage": _usage(completion.prompt_tokens, completion.completion_tokens)}

    async def _text(self, session: ChatSession, body: dict[str, Any]) -> dict[str, Any]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise RequestError("'prompt' must be one non-empty string (a session is one sample)")
        text, finish, prompt_tokens, completion_tokens = await session.complete_text(prompt,
                                                                                     **_generation_options(body))
        return {"id": f"cmpl-{secrets.token_hex(8)}", "object": "text_completion", "created": int(time.time()),
                "model": self.model,
                "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
                "usage": _usage(prompt_tokens, completion_tokens)}

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model", "created": 0,
                                                              "owned_by": "slipstream"}]})


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RequestError(f"the request body is not JSON: {error}") from None
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, not {type(body).__name__}")
    if body.get("n", 1) != 1:
        raise RequestError(f"'n' must be 1, got {body['n']!r}: a session is one sample; open one per sample")
    return body


def _generation_options(body: dict[str, Any]) -> dict[str, Any]:
    """What a client may set: how many tokens and where to stop. Sampling itself is the run's."""
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise RequestError(f"'max_tokens' must be a positive integer, got {max_tokens!r}")
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(f"'stop' must be a string or a list of non-empty strings, got {stop!r}")
    return {"max_tokens": max_tokens, "stop": tuple(stop)}


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not body.get("stream"):
        raise RequestError("'stream_options' is only allowed with 'stream': true")
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise RequestError(f"'stream_options' must be an object with a boolean 'include_usage', got {options!r}")
    return bool(options.get("include_usage", False))


def _chunks(response: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
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
    return chunks


async def _stream(request: web.Request, chunks: list[dict[str, Any]]) -> web.StreamResponse:
    stream = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await stream.prepare(request)
    for chunk in chunks:
        await stream.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    await stream.write(b"data: [DONE]\n\n")
    await stream.write_eof()
    return stream


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _error(message: str, status: int, *, code: str | None = None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": code}},
                             status=status)
