"""An agent written against the OpenAI client library, trained as it is: no Slipstream import in its loop.

Run it with `--agent-function-path examples.openai_agent:solve`. Each sample is one call of `solve`, whose
`episode.base_url` is a session on the rollout worker's OpenAI-compatible endpoint: the agent's chat calls are the
sample's model turns, its tool results and follow-up messages the masked tokens between them, and the reward
function scores the whole conversation's text.

The agent is a common shape: answer with the `add` tool at hand (Hermes-style `<tool_call>` blocks come back as
`message.tool_calls`), then, once the model stops calling tools (or runs out of tokens), ask it once to check and
restate its answer.
"""

from __future__ import annotations

import json
from typing import Any

from openai import AsyncOpenAI, BadRequestError

from actors.plugins import Episode

MAX_TOOL_ROUNDS = 3
REVIEW = "Check that once more and give only the final answer."
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "the sum of two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]


def add(a: int, b: int) -> int:
    return int(a) + int(b)


FUNCTIONS = {"add": add}  # for the built-in tool loop: --agent-tools-path examples.openai_agent:FUNCTIONS


def run_tool(name: str, arguments: str) -> str:
    """A tool's result for the model, or the error it made, in words."""
    if name != "add":
        return f"error: no tool {name!r}; the tool is 'add'"
    try:
        return str(add(**json.loads(arguments)))
    except (TypeError, ValueError) as error:
        return f"error: {error}"


async def solve(episode: Episode) -> dict[str, Any]:
    async with AsyncOpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0, timeout=120) as client:
        messages: list[dict[str, Any]] = list(episode.messages)
        tool_rounds = 0
        try:
            while True:
                reply = await client.chat.completions.create(model=episode.model, messages=messages, tools=TOOLS)
                choice = reply.choices[0]
                messages.append(choice.message.model_dump(exclude_none=True))
                if choice.finish_reason != "tool_calls" or tool_rounds == MAX_TOOL_ROUNDS:
                    break
                tool_rounds += 1
                messages += [{"role": "tool", "tool_call_id": call.id,
                              "content": run_tool(call.function.name, call.function.arguments)}
                             for call in choice.message.tool_calls or []]
            messages.append({"role": "user", "content": REVIEW})  # a cut-off answer is reviewed too
            choice = (await client.chat.completions.create(model=episode.model, messages=messages,
                                                           tools=TOOLS)).choices[0]
        except BadRequestError as error:
            if error.code != "context_length_exceeded":
                raise
            # The conversation filled the context: the turns so far are the sample, as far as they got.
        return {"final_answer": choice.message.content or "", "tool_rounds": tool_rounds}
