"""Trajectory trees (#58): an agent that rewrites its context (drops old turns, summarises its history, runs a
sub-agent with a fresh context on the same session) goes on in a new linear segment of its episode instead of
being refused. Driven by the real `openai` and `anthropic` clients over the rollout worker's endpoint and a real
engine (a tiny model, greedy: an eval group); each segment must be the engine's tokens, its prompt the rewritten
conversation rendered fresh and masked, linked to the episode and to the segment it forked from."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import anthropic
import numpy as np
import openai
import pytest

from actors.rollout.agent import AgentRunner, agent_generate_for
from actors.rollout.chat_session import ChatSession
from actors.rollout.generate import RolloutContext
from actors.rollout.trajectory import render
from bus.codec import decode, encode
from bus.episodes import group_problem
from bus.schema import Sample, messages_equal
from examples.anthropic_agent import TOOLS as ANTHROPIC_TOOLS
from tests.actors import test_agent_episodes
from tests.actors.test_agent_episodes import eval_group, run_config, served_episodes, serving, with_context
from tests.support.agents import CHECKER, SUMMARY

pytestmark = pytest.mark.integration
endpoint = test_agent_episodes.endpoint  # a tiny model's engine behind a started endpoint

ASK = {"role": "user", "content": "2+3="}


async def chat(client: openai.AsyncOpenAI, messages: list[dict[str, Any]]) -> tuple[dict[str, Any], int]:
    """The model's reply to `messages` as the message a client sends back, and how many tokens it wrote."""
    reply = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    return reply.choices[0].message.model_dump(exclude_none=True), reply.usage.completion_tokens


def tokens_of(session: ChatSession, segment: int) -> list[int]:
    trajectory = session.segments[segment].trajectory
    return [*trajectory.prompt_ids, *trajectory.response_ids]


def assert_one_fresh_turn(sample: Sample, context: RolloutContext, conversation: list[dict[str, Any]],
                          written: int) -> None:
    """A segment of one model turn after `conversation`: its prompt is that conversation rendered by the chat
    template (masked, earlier model turns included), its response the engine's tokens, all trained."""
    assert sample.tokens[:sample.prompt_tokens].tolist() == render(context.tokenizer, conversation,
                                                                   add_generation_prompt=True)
    assert sample.response_length == written and sample.metadata["turns"] == 1
    assert np.all(sample.loss_mask == 1) and np.all(sample.rollout_log_probs < 0)


async def test_a_harness_that_drops_old_turns_goes_on_in_a_new_segment_rendered_fresh(endpoint) -> None:
    served, context = endpoint
    session = ChatSession(context, eval_group(), 0)
    async with openai.AsyncOpenAI(base_url=served.open(session), api_key="x", max_retries=0) as client:
        conversation = [ASK]
        for follow in ["and 1+1=", "and 4+4="]:
            conversation += [(await chat(client, conversation))[0], {"role": "user", "content": follow}]
        conversation.append((await chat(client, conversation))[0])
        main = tokens_of(session, 0)
        # The harness keeps the task and the last exchange, and drops the turns between.
        window = [ASK, *conversation[-2:], {"role": "user", "content": "and 5+5="}]
        answer, written = await chat(client, window)
        assert tokens_of(session, 0) == main, "the fork changed the conversation it forked from"
        # The window goes on: its segment continues, no new one.
        await chat(client, [*window, answer, {"role": "user", "content": "sure?"}])
    old, new = session.to_samples()
    assert (old.sample_id, new.sample_id) == ("g/0", "g/0.1") and old.index == new.index == 0
    assert (old.segment, old.parent_segment, new.segment, new.parent_segment) == (0, None, 1, 0)
    assert old.segments == new.segments == 2 and (old.ends_episode, new.ends_episode) == (False, True)
    assert old.tokens.tolist() == main and old.metadata["turns"] == 3
    assert new.metadata["shared_messages"] == 1 and new.metadata["turns"] == 2
    assert new.messages[:len(window) + 1] == [*window, answer]
    assert_one_fresh_turn(first_turn(new), context, window, written)
    assert messages_equal(decode(encode(new)), new)


def first_turn(sample: Sample) -> Sample:
    """`sample` cut after its first model turn (its first run of trained tokens)."""
    mask = sample.loss_mask.tolist()
    end = mask.index(0) if 0 in mask else len(mask)
    cut = sample.prompt_tokens + end
    return Sample(sample_id=sample.sample_id, group_id=sample.group_id, index=sample.index, prompt=sample.prompt,
                  prompt_tokens=sample.prompt_tokens, tokens=sample.tokens[:cut], response_length=end,
                  loss_mask=sample.loss_mask[:end], rollout_log_probs=sample.rollout_log_probs[:end],
                  token_versions=sample.token_versions[:end], metadata={"turns": 1})


async def test_a_summarised_history_forks_from_the_conversation_it_shares_a_prefix_with(endpoint) -> None:
    """Over Responses, as a client that keeps its own state sends whole conversations; `previous_response_id` then
    takes the episode back to the conversation before the summary, which goes on in its own segment."""
    served, context = endpoint
    session = ChatSession(context, eval_group(), 0)
    async with openai.AsyncOpenAI(base_url=served.open(session), api_key="x", max_retries=0) as client:
        first = await client.responses.create(model="tiny", input=[ASK], max_output_tokens=4)
        history = [ASK, *[item.model_dump(exclude_none=True) for item in first.output],
                   {"role": "user", "content": "and 1+1="}]
        second = await client.responses.create(model="tiny", input=history, max_output_tokens=4)
        summarised = [ASK, {"role": "user", "content": SUMMARY}]
        summary = await client.responses.create(model="tiny", input=summarised, max_output_tokens=4)
        await client.responses.create(model="tiny", previous_response_id=second.id, max_output_tokens=4,
                                      input=[{"role": "user", "content": "and 2+2="}])
    main, compacted = session.to_samples()
    assert (main.metadata["turns"], compacted.metadata["turns"]) == (3, 1)
    assert compacted.parent_segment == 0 and compacted.metadata["shared_messages"] == 1
    assert (main.ends_episode, compacted.ends_episode) == (True, False)  # the episode ended where it went back
    assert_one_fresh_turn(compacted, context, summarised, summary.usage.output_tokens)


async def test_a_sub_agent_with_a_fresh_context_is_a_segment_and_the_main_agent_goes_on_in_its_own(
        endpoint) -> None:
    """Over Anthropic Messages, as Claude-Code-style harnesses dispatch a sub-agent: its own system prompt, no
    tools, nothing of the main conversation; the main agent's next call continues the main segment."""
    served, context = endpoint
    session = ChatSession(context, eval_group(), 0)
    base_url = served.open(session).removesuffix("/v1")
    async with anthropic.AsyncAnthropic(base_url=base_url, api_key="x", max_retries=0) as client:
        async def say(messages: list[dict[str, Any]], **options: Any) -> dict[str, Any]:
            reply = await client.messages.create(model="tiny", max_tokens=4, messages=messages, **options)
            return {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in reply.content]}

        main = [ASK]
        main += [await say(main, tools=ANTHROPIC_TOOLS), {"role": "user", "content": "ask the checker"}]
        task = [{"role": "user", "content": "is 5 right?"}]
        task += [await say(task, system=CHECKER), {"role": "user", "content": "sure?"}]
        await say(task, system=CHECKER)
        await say([*main, await say(main, tools=ANTHROPIC_TOOLS), {"role": "user", "content": "checker: yes"}],
                  tools=ANTHROPIC_TOOLS)
    main_segment, sub_agent = session.to_samples()
    assert (main_segment.metadata["turns"], sub_agent.metadata["turns"]) == (3, 2)
    assert sub_agent.parent_segment == 0 and sub_agent.metadata["shared_messages"] == 0
    assert sub_agent.messages[0] == {"role": "system", "content": CHECKER}
    assert (main_segment.ends_episode, sub_agent.ends_episode) == (True, False)


async def test_a_forks_first_call_that_does_not_fit_leaves_the_episode_as_it_was(tiny_model_path: Path) -> None:
    async with serving(tiny_model_path, max_model_len=64) as (served, context):
        session = ChatSession(context, eval_group(), 0)
        async with openai.AsyncOpenAI(base_url=served.open(session), api_key="x", max_retries=0) as client:
            answer, _ = await chat(client, [ASK])
            main = tokens_of(session, 0)
            with pytest.raises(openai.BadRequestError, match="leaves no room") as refused:
                await chat(client, [{"role": "user", "content": "9" * 80}])
            assert refused.value.code == "context_length_exceeded"
            assert len(session.segments) == 1 and session.current == 0 and tokens_of(session, 0) == main
            await chat(client, [ASK, answer, {"role": "user", "content": "1+1="}])
        (sample,) = session.to_samples()
        assert sample.metadata["turns"] == 2 and sample.ends_episode


def test_an_agents_episode_that_rewrites_its_context_is_its_segments_linked_by_episode_and_parent(
        tiny_model_path: Path) -> None:
    """Through the agent runner, as a run drives it: each episode's samples are its three segments, the metadata
    the agent returned on each, the group whole by the buffer's rule."""
    config = run_config(tiny_model_path, agent_function_path="tests.support.agents:rewrites_its_context")
    runner = agent_generate_for(config)
    assert isinstance(runner, AgentRunner)
    samples = asyncio.run(with_context(tiny_model_path, config, served_episodes(runner, n_samples=2)))
    assert [(s.index, s.segment, s.parent_segment, s.ends_episode) for s in samples] == [
        (0, 0, None, False), (0, 1, 0, False), (0, 2, 0, True), (1, 0, None, False), (1, 1, 0, False),
        (1, 2, 0, True)]
    assert [s.metadata["turns"] for s in samples] == [3, 1, 1] * 2
    assert [s.metadata.get("shared_messages") for s in samples] == [None, 0, 1] * 2
    assert all(s.metadata["final_answer"] == samples[2 + 3 * s.index].metadata["final_answer"] for s in samples)
    assert group_problem(samples, 2) is None and not runner.endpoint.sessions
