"""The agent of `examples/openai_agent.py` written against the Anthropic Messages API, as Claude-Code-style
harnesses speak it: `client.messages.create` with tools, `tool_use` blocks answered by `tool_result` blocks, the
whole conversation sent every call.

Run it with `--agent-function-path examples.anthropic_agent:solve`. The Anthropic client appends `/v1/messages` to
its base URL, so it takes `episode.anthropic_base_url` (the session's URL without `/v1`); any API key is accepted.
"""

from __future__ import annotations

import json
from typing import Any

from anthropic import AsyncAnthropic, BadRequestError

from actors.plugins import Episode
from examples.openai_agent import MAX_TOOL_ROUNDS, REVIEW, run_tool

MAX_TOKENS = 1024  # the Messages API asks for it; the run's --rollout-max-response-len caps every turn anyway
TOOLS = [{"name": "add", "description": "the sum of two integers",
          "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "required": ["a", "b"]}}]


def answer_of(reply: Any) -> str:
    return "".join(block.text for block in reply.content if block.type == "text")


async def solve(episode: Episode) -> dict[str, Any]:
    system = "\n\n".join(m["content"] for m in episode.messages if m["role"] == "system")
    messages: list[dict[str, Any]] = [m for m in episode.messages if m["role"] != "system"]
    options: dict[str, Any] = {"model": episode.model, "max_tokens": MAX_TOKENS, "tools": TOOLS,
                               **({"system": system} if system else {})}
    async with AsyncAnthropic(base_url=episode.anthropic_base_url, api_key=episode.api_key, max_retries=0,
                              timeout=120) as client:
        answer, tool_rounds = "", 0
        try:
            while True:
                reply = await client.messages.create(messages=messages, **options)
                messages.append({"role": "assistant", "content": reply.content})
                answer = answer_of(reply)
                calls = [block for block in reply.content if block.type == "tool_use"]
                if reply.stop_reason != "tool_use" or tool_rounds == MAX_TOOL_ROUNDS:
                    break
                tool_rounds += 1
                results = [{"type": "tool_result", "tool_use_id": call.id,
                            "content": run_tool(call.name, json.dumps(call.input))} for call in calls]
                messages.append({"role": "user", "content": results})
            messages.append({"role": "user", "content": REVIEW})  # a cut-off answer is reviewed too
            answer = answer_of(await client.messages.create(messages=messages, **options))
        except BadRequestError as error:
            if "prompt is too long" not in error.message:  # what Anthropic says of a full context
                raise
            # The conversation filled the context: the turns so far are the sample, as far as they got.
        return {"final_answer": answer, "tool_rounds": tool_rounds}

