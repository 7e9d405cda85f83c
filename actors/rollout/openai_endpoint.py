"""The HTTP endpoint a rollout worker serves while agents run, one session per sample, in the three APIs agent
harnesses speak: OpenAI Chat Completions (`/v1/chat/completions`, `/v1/completions`; `actors.rollout.api_chat`),
OpenAI Responses (`/v1/responses`; `actors.rollout.api_responses`) and Anthropic Messages (`/v1/messages`;
`actors.rollout.api_anthropic`), and `/v1/models` in the shape of whichever client asks.

An episode's base URL is `http://HOST:PORT/sessions/SESSION/v1` (the Anthropic client's is the same without `/v1`:
it appends `/v1/messages` itself), so an unmodified client (or any agent framework built on one) drives exactly one
sample, and every call it makes is recorded into that sample's trajectory as tokens. A session lives on one worker,
whose router sends all its calls to one engine while that engine lives (docs/router.md).

A request's `model` says which policy answers it, as an OpenAI-compatible server's served model names do: none, the
run's model name (`episode.model`) or the episode's own policy is the episode's own conversation; another policy of
a run of several goes to that policy, in a conversation of its own that trains that policy only
(`actors.rollout.cross_policy.AgentCalls`; docs/multi-policy.md). Any other name is refused (404
`model_not_found`) naming what is served.

This module is the HTTP layer: routes, sessions, one call at a time per session, server-sent events, and errors in
the shape of the API a path belongs to (OpenAI's `{"error": {...}}`, Anthropic's `{"type": "error", "error":
{...}}`), naming the field and what is wrong: a body that is not JSON, `n` other than 1 (a session is one sample), a
conversation that does not extend the session's, a second call while one is running, an unknown session, and any
path or method that is not served (naming what is). None of that ends the worker; the agent sees the error and its
episode decides what to do.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from actors.rollout.api_anthropic import AnthropicMessages, anthropic_error
from actors.rollout.api_chat import ChatCompletions
from actors.rollout.api_common import ErrorBody, Events, RequestError, Serve, openai_error
from actors.rollout.api_responses import Responses
from actors.rollout.chat_session import ChatSession, ConversationDiverged
from actors.rollout.cross_policy import AgentCalls
from actors.rollout.generate import NoRoomError

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SESSION_PREFIX = "/sessions/{session}/v1/"


@dataclass(frozen=True)
class Route:
    """One served call: its method and path under a session's base URL, the adapter, its API's error shape."""

    method: str
    path: str
    serve: Serve
    error_body: ErrorBody
    api: str


class OpenAIEndpoint:
    def __init__(self, *, host: str = "127.0.0.1", model: str = "policy") -> None:
        self.host, self.model = host, model
        self.port: int | None = None
        self.sessions: dict[str, ChatSession] = {}
        self.calls: dict[str, AgentCalls] = {}  # by session: its episode's calls to other policies
        self.busy: set[tuple[str, str | None]] = set()  # (session, policy called) with a call running
        self.runner: web.AppRunner | None = None
        self.refusing = False  # the worker stops: a call now would reach an engine already aborted
        chat, responses, messages = ChatCompletions(model), Responses(model), AnthropicMessages(model)
        self.routes = [Route("POST", "chat/completions", chat.chat, openai_error, "OpenAI"),
                       Route("POST", "completions", chat.text, openai_error, "OpenAI"),
                       Route("POST", "responses", responses.create, openai_error, "OpenAI Responses"),
                       Route("POST", "messages", messages.create, anthropic_error, "Anthropic")]

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[self._unserved])
        for route in self.routes:
            app.router.add_route(route.method, SESSION_PREFIX + route.path, self._call(route))
        app.router.add_get(SESSION_PREFIX + "models", self._models)
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

    def open(self, session: ChatSession, calls: AgentCalls | None = None) -> str:
        """A new session's base URL; `calls` serves the requests that name another policy of the run."""
        if self.port is None:
            raise RuntimeError("the OpenAI endpoint has not started")
        key = secrets.token_hex(8)
        self.sessions[key] = session
        if calls is not None:
            self.calls[key] = calls
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}/sessions/{key}/v1"

    def close(self, base_url: str) -> None:
        key = base_url.rstrip("/").split("/")[-2]
        self.sessions.pop(key, None)
        self.calls.pop(key, None)

    def named(self, key: str, session: ChatSession, model: Any) -> tuple[ChatSession, str | None]:
        """The conversation a request's `model` asks for, and the other policy it names (None: the episode's own)."""
        if model is not None and not isinstance(model, str):
            raise RequestError(f"'model' must be a string, got {type(model).__name__}")
        context = session.context
        if model in (None, "", self.model) or model == context.policy:
            return session, None
        calls = self.calls.get(key)
        if calls is not None and model in context.policy_engines:
            return calls.session(model, session.index), model
        if not context.policy_engines:
            raise RequestError(f"model {model!r} is not served here: this run has one policy, served as "
                               f"{self.model!r} (or with no model given); an episode calls another policy in a run "
                               "of several (docs/multi-policy.md)", 404, code="model_not_found")
        if model in context.policies_elsewhere:
            raise RequestError(f"model {model!r} is not served here: it is served {context.policies_elsewhere[model]};"
                               f" an episode calls only the policies served beside it, "
                               f"{sorted(context.policy_engines)}", 404, code="model_not_found")
        raise RequestError(f"model {model!r} is not served here: name a policy of this run "
                           f"{sorted(context.policy_engines)}; the episode's own, {context.policy!r}, is also served "
                           f"as {self.model!r} or with no model given", 404, code="model_not_found")

    def _call(self, route: Route) -> Handler:
        """One session call: the session looked up and held for the call, every refusal an error of the route's
        API."""

        async def serve(request: web.Request) -> web.StreamResponse:
            key = request.match_info["session"]
            try:
                session = self.sessions.get(key)
                if session is None:
                    raise RequestError(f"no session {key!r}: it ended with its episode, or never existed", 404)
                body = await _json_body(request)
                session, policy = self.named(key, session, body.get("model"))
                if (key, policy) in self.busy:
                    raise RequestError("a call is already running in this session: an episode is one "
                                       "conversation (with each policy it calls), its calls one after another", 409)
                if self.refusing:  # checked with no await before the engine call: the abort that follows ends it
                    raise RequestError("the rollout worker is stopping; this episode is over", 503)
                self.busy.add((key, policy))
                try:
                    reply = await route.serve(session, body)
                finally:
                    self.busy.discard((key, policy))
                if isinstance(reply, Events):
                    return await _stream(request, reply)
                return web.json_response(reply)
            except RequestError as error:
                return web.json_response(route.error_body(str(error), error.status, error.code), status=error.status)
            except NoRoomError as error:
                return web.json_response(route.error_body(str(error), 400, "context_length_exceeded"), status=400)
            except (ConversationDiverged, ValueError) as error:  # the conversation's fault, not ours
                return web.json_response(route.error_body(str(error), 400, None), status=400)

        return serve

    async def _models(self, request: web.Request) -> web.Response:
        """The names a session's calls may give as `model` (the run's model name, and each policy of a run of
        several), as OpenAI's model list, or Anthropic's when an Anthropic client asks."""
        session = self.sessions.get(request.match_info["session"])
        names = [self.model, *sorted(session.context.policy_engines if session is not None else ())]
        if "anthropic-version" in request.headers:
            models = [{"type": "model", "id": name, "display_name": name, "created_at": "1970-01-01T00:00:00Z"}
                      for name in names]
            return web.json_response({"data": models, "has_more": False, "first_id": names[0],
                                      "last_id": names[-1]})
        return web.json_response({"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                                              "owned_by": "slipstream"} for name in names]})

    @web.middleware
    async def _unserved(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """A path or method the endpoint does not serve: an error in the shape of the API the path belongs to,
        naming what is served, instead of aiohttp's plain-text 404."""
        try:
            return await handler(request)
        except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as refusal:
            anthropic = "/messages" in request.path or "anthropic-version" in request.headers
            error_body = anthropic_error if anthropic else openai_error
            return web.json_response(error_body(self._unserved_message(request, refusal), refusal.status, None),
                                     status=refusal.status)

    def _unserved_message(self, request: web.Request, refusal: web.HTTPException) -> str:
        served = ", ".join([*(f"{route.method} /{route.path} ({route.api})" for route in self.routes),
                            "GET /models"])
        if isinstance(refusal, web.HTTPMethodNotAllowed):
            return (f"{request.method} {request.path} is not served: that path takes "
                    f"{', '.join(sorted(refusal.allowed_methods))}")
        said = f"{request.method} {request.path} is not served here"
        if not request.path.startswith("/sessions/"):
            return (f"{said}: every call goes under a session's base URL, http://HOST:PORT/sessions/SESSION/v1 "
                    "(episode.base_url; the Anthropic client takes episode.anthropic_base_url, without /v1)")
        if request.path.endswith("/v1/v1/messages"):
            return (f"{said}: the Anthropic client appends /v1/messages to its base URL itself, so give it "
                    "episode.anthropic_base_url (the session URL without /v1)")
        return f"{said}. Under a session's base URL (/sessions/SESSION/v1) this endpoint serves {served}"


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


async def _stream(request: web.Request, reply: Events) -> web.StreamResponse:
    stream = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await stream.prepare(request)
    for event, data in reply.events:
        named = f"event: {event}\n" if event else ""
        text = data if isinstance(data, str) else json.dumps(data)
        await stream.write(f"{named}data: {text}\n\n".encode())
    await stream.write_eof()
    return stream
