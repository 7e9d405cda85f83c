"""A generate function whose episodes call two policies: every group of policy "add" is answered by "add", and its
first answer is then put to policy "sums", whose answers form a group of sums' own (`RolloutContext.group_for`).
Groups of "sums" are answered by sums alone. The prompts of sums' turns start with `SUMS_TURN`, so a test can tell
them from sums' own prompts. `add_asks_sums` is the same episode as an agent's, over the endpoint."""

from __future__ import annotations

from typing import Any

import openai

from actors.rollout.agent import Episode
from actors.rollout.generate import RolloutContext, default_generate, make_sample
from bus.schema import STATUS_BY_FINISH, PromptGroup, Sample
from engines.inference.base import GenerateRequest
from policies.filters import FilterGroup

SUMS_TURN = "Say it again: "


async def add_then_sums(context: RolloutContext, group: PromptGroup) -> list[Sample]:
    own = await default_generate(context, group)
    if context.policy != "add":
        return own
    turns = context.group_for("sums", group, "echo", SUMS_TURN + own[0].response, label="7")
    prompt_ids = context.prompt_ids(turns.prompt)
    params = context.sampling_params(turns, prompt_tokens=len(prompt_ids))
    outputs = await context.engine_of("sums").generate(GenerateRequest(context.request_id(turns), prompt_ids, params))
    return own + [make_sample(turns, index, prompt_ids, out.output_ids, out.log_probs, out.versions,
                              response=context.decode_response(out.output_ids),
                              status=STATUS_BY_FINISH[out.finish_reason])
                  for index, out in enumerate(outputs)]


def turns_in_add_episodes_only(group: FilterGroup) -> bool:
    """A filter for sums' buffer: keep the groups of sums' turns in add's episodes, drop sums' own prompts' groups."""
    return "host_group" in group.metadata


async def add_asks_sums(episode: Episode) -> dict[str, Any]:
    """An agent: add's episode answers its prompt, then puts its answer to sums (the request's `model`), whose
    reply is sums' turn. Sums' own episodes answer their prompt only."""
    async with openai.AsyncOpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0) as client:
        own = await client.chat.completions.create(model=episode.model, messages=episode.messages)
        answer = own.choices[0].message.content or ""
        if episode.policy == "add":
            await client.chat.completions.create(model="sums",
                                                 messages=[{"role": "user", "content": SUMS_TURN + answer}])
    return {"asked": answer}

