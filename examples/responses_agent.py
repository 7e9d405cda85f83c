"""The agent of `examples/openai_agent.py` written against the OpenAI Responses API, as Codex-style harnesses speak
it: `client.responses.create` with function tools, the tool outputs sent as `function_call_output` items after
`previous_response_id`, so each call carries only what is new.

Run it with `--agent-function-path examples.responses_agent:solve`. `episode.base_url` serves `/v1/responses` as it
serves `/v1/chat/completions`: the same session, the same tokens.
"""

from __future__ import annotations

from typing import Any

from openai import AsyncOpenAI, BadRequestError

from actors.plugins import Episode
from examples.openai_agent import MAX_TOOL_ROUNDS, REVIEW, run_tool

TOOLS = [{"type": "function", "name": "add", "description": "the sum of two integers",
          "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                         "required": ["a", "b"]}}]


async def solve(episode: Episode) -> dict[str, Any]:
    async with AsyncOpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0, timeout=120) as client:
        answer, tool_rounds = "", 0
        try:
            response = await client.responses.create(model=episode.model, input=episode.messages, tools=TOOLS)
            while True:
                answer = response.output_text
                calls = [item for item in response.output if item.type == "function_call"]
                if not calls or response.status != "completed" or tool_rounds == MAX_TOOL_ROUNDS:
                    break
                tool_rounds += 1
                outputs = [{"type": "function_call_output", "call_id": call.call_id,
                            "output": run_tool(call.name, call.arguments)} for call in calls]
                response = await client.responses.create(model=episode.model, previous_response_id=response.id,
                                                         input=outputs, tools=TOOLS)
            review = [{"role": "user", "content": REVIEW}]  # a cut-off answer is reviewed too
            response = await client.responses.create(model=episode.model, previous_response_id=response.id,
                                                     input=review, tools=TOOLS)
            answer = response.output_text
        except BadRequestError as error:
            if error.code != "context_length_exceeded":
                raise
            # The conversation filled the context: the turns so far are the sample, as far as they got.
        return {"final_answer": answer, "tool_rounds": tool_rounds}
