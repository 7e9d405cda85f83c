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


async def responses_or_anthropic(episode: Episode) -> dict[str, Any]:
    """The example agent on the Responses API for even samples, on the Anthropic Messages API for odd ones."""
    from examples import anthropic_agent, responses_agent

    if episode.sample_index % 2 == 0:
        return {**await responses_agent.solve(episode), "api": "responses"}
    return {**await anthropic_agent.solve(episode), "api": "anthropic"}
