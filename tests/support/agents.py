"""Agents for the agent-episode tests, loaded by `--agent-function-path` like a user's."""

from __future__ import annotations

import asyncio
from typing import Any

import openai

from actors.rollout.agent import Episode


async def one_call_then_trouble(episode: Episode) -> dict[str, Any] | None:
    """Every sample makes one call; then sample 1 raises and sample 2 overruns any short deadline."""
    async with openai.AsyncOpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0) as client:
        await client.chat.completions.create(model=episode.model, messages=episode.messages, max_tokens=4)
    if episode.sample_index == 1:
        raise RuntimeError("the sandbox is gone")
    if episode.sample_index == 2:
        await asyncio.sleep(30)
    return None


async def one_call(episode: Episode) -> dict[str, Any] | None:
    """One chat call, then done: an episode that is in the engine for as long as that call takes."""
    async with openai.AsyncOpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0) as client:
        await client.chat.completions.create(model=episode.model, messages=episode.messages)
    return None


async def answers_with(episode: Episode, result: dict[str, Any]) -> None:
    """Asks once with the `add` tool, answers every call the model makes with `result` (a tool message's fields
    besides role and id), and asks again."""
    from examples.openai_agent import TOOLS

    async with openai.AsyncOpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0) as client:
        messages = list(episode.messages)
        reply = (await client.chat.completions.create(model=episode.model, messages=messages, tools=TOOLS)).choices[0]
        messages.append(reply.message.model_dump(exclude_none=True))
        messages += [{"role": "tool", "tool_call_id": call.id, **result} for call in reply.message.tool_calls or []]
        await client.chat.completions.create(model=episode.model, messages=messages, tools=TOOLS, max_tokens=4)


async def tool_failed_by_its_text(episode: Episode) -> None:
    await answers_with(episode, {"content": "Error: the calculator is offline"})


async def tool_failed_by_its_flag(episode: Episode) -> None:
    await answers_with(episode, {"content": "the calculator is offline", "is_error": True})


async def tool_answered(episode: Episode) -> None:
    await answers_with(episode, {"content": "5"})


async def counts_its_own_tools(episode: Episode) -> dict[str, Any]:
    """Answers like `tool_answered`, and reports counts of its own: a tool it ran without the model asking."""
    await tool_answered(episode)
    return {"tool_calls": 3, "tool_errors": 2}


async def miscounts_its_tools(episode: Episode) -> dict[str, Any]:
    await tool_answered(episode)
    return {"tool_calls": "three"}


SUMMARY = "So far: the answer was checked once."
CHECKER = "You check answers. Say yes or no."


async def rewrites_its_context(episode: Episode) -> dict[str, Any]:
    """A harness that rewrites its context twice, as coding agents do: it asks and has the answer reviewed, hands
    the answer to a sub-agent with a fresh context on the same session, goes on in its own conversation with the
    sub-agent's verdict, then compacts its history into a summary and asks once more. Three segments: the main
    conversation, the sub-agent's (forked from it, nothing shared) and the compacted one (sharing the prompt)."""
    async with openai.AsyncOpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0) as client:
        async def say(messages: list[dict[str, Any]]) -> dict[str, Any]:
            reply = await client.chat.completions.create(model=episode.model, messages=messages, max_tokens=4)
            return reply.choices[0].message.model_dump(exclude_none=True)

        main = [*episode.messages]
        main.append(await say(main))
        main += [{"role": "user", "content": "check it"}]
        main.append(await say(main))
        verdict = await say([{"role": "system", "content": CHECKER},
                             {"role": "user", "content": main[-1].get("content") or "?"}])
        main += [{"role": "user", "content": f"checker: {verdict.get('content')}"}]
        main.append(await say(main))
        compacted = [*episode.messages, {"role": "user", "content": SUMMARY}]
        final = await say(compacted)
    return {"final_answer": final.get("content") or ""}


async def every_client_or_rewrites_its_context(episode: Episode) -> dict[str, Any]:
    """One agent per sample of a group of four: the example agent of each client library (the OpenAI client's Chat
    Completions, its Responses API, the Anthropic client's Messages API), then `rewrites_its_context`. One run
    shows each trains, beside episodes that are trees of segments."""
    from examples import anthropic_agent, openai_agent, responses_agent

    api, agent = (("chat", openai_agent.solve), ("responses", responses_agent.solve),
                  ("anthropic", anthropic_agent.solve), ("rewrites", rewrites_its_context))[episode.sample_index % 4]
    return {**await agent(episode), "api": api}
