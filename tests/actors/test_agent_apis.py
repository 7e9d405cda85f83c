"""The endpoint's OpenAI Responses and Anthropic Messages surfaces (#58), driven by the real `openai` and `anthropic`
client libraries over a real engine. The model is the one `test_agent_episodes` teaches to answer "2+3=" with a
call to `add` and then with the tool's result, so every episode below is the model's own, greedy (an eval group),
and its sample must be token for token the taught conversation: the engine's tokens, trained on, the rest masked.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import numpy as np
import openai
import pytest
import structlog

from actors.config import build_config
from actors.data.tool_prompts import describe_tools, template_renders_tools, with_tools_described
from actors.rollout.agent import AgentRunner, agent_generate_for
from actors.rollout.chat_session import ChatSession
from actors.rollout.generate import RolloutContext
from actors.rollout.openai_endpoint import OpenAIEndpoint
from actors.rollout.tool_calls import parse_tool_calls
from bus.schema import Sample
from engines.inference.torch_engine import TorchEngine
from examples.anthropic_agent import TOOLS as ANTHROPIC_TOOLS
from examples.openai_agent import REVIEW
from examples.openai_agent import TOOLS as CHAT_TOOLS
from examples.responses_agent import TOOLS as RESPONSES_TOOLS
from tests.actors import test_agent_episodes
from tests.actors.test_agent_episodes import (
    CALL,
    eval_group,
    run_config,
    served_episodes,
    teach_conversation,
    texts,
    with_context,
)

# Fixtures of the agent-episode tests: the taught model, and a tiny model's engine behind a started endpoint.
taught, tool_model, endpoint = test_agent_episodes.taught, test_agent_episodes.tool_model, test_agent_episodes.endpoint

ASK = "2+3="
NEXT = '<tool_call>{"name": "next"}</tool_call>'
TWO_CALLS = [{"role": "user", "content": "count"}, {"role": "assistant", "content": NEXT},
             {"role": "tool", "content": "1"}, {"role": "assistant", "content": NEXT},
             {"role": "tool", "content": "2"}, {"role": "assistant", "content": "2"}]
TAUGHT_TEXT = (f"{CALL}<|im_end|>\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n5<|im_end|>\n"
               f"<|im_start|>user\n{REVIEW}<|im_end|>\n<|im_start|>assistant\n5<|im_end|>")


def on_endpoint(model: Path, body: Callable[[OpenAIEndpoint, RolloutContext], Awaitable[Any]],
                **settings: Any) -> Any:
    async def served(context: RolloutContext) -> Any:
        endpoint = OpenAIEndpoint(model="tiny")
        await endpoint.start()
        try:
            return await body(endpoint, context)
        finally:
            await endpoint.stop()

    return asyncio.run(with_context(model, run_config(model, **settings), served))


def assert_is_the_taught_episode(sample: Sample, teach: Sample) -> None:
    """The engine's tokens as the taught conversation lays them out: the model's turns trained on (with their
    log-probs), the tool result, the review and the template's markers masked (log-prob 0)."""
    assert sample.tokens.tolist() == teach.tokens.tolist()
    assert sample.loss_mask.tolist() == teach.loss_mask.tolist()
    mask = sample.loss_mask.astype(bool)
    assert np.all(sample.rollout_log_probs[mask] < 0) and np.all(sample.rollout_log_probs[~mask] == 0)
    assert sample.status == "completed" and sample.metadata["turns"] == 3
    assert sample.metadata["undeclared_tool_calls"] == 0


def model_turns(sample: Sample) -> list[int]:
    """The token count of each run of trained tokens: one per model turn."""
    runs, mask = [], sample.loss_mask.tolist()
    for position, bit in enumerate(mask):
        if bit and (position == 0 or not mask[position - 1]):
            runs.append(0)
        if bit:
            runs[-1] += 1
    return runs


@pytest.mark.integration
def test_a_responses_client_runs_a_tool_episode_whose_sample_is_the_engines_tokens(taught) -> None:
    """Stateful: the tool output and the review go after `previous_response_id`, with nothing resent (the second
    call leaves the tools out too: they are the conversation's)."""
    tool_model, teach = taught

    async def converse(served: OpenAIEndpoint, context: RolloutContext) -> tuple[list[Any], Sample]:
        session = ChatSession(context, eval_group(), 0)
        async with openai.AsyncOpenAI(base_url=served.open(session), api_key="x", max_retries=0) as client:
            first = await client.responses.create(model="tiny", input=ASK, tools=RESPONSES_TOOLS)
            (call,) = first.output
            second = await client.responses.create(model="tiny", previous_response_id=first.id, input=[
                {"type": "function_call_output", "call_id": call.call_id, "output": "5"}])
            third = await client.responses.create(model="tiny", previous_response_id=second.id,
                                                  input=[{"role": "user", "content": REVIEW}], tools=RESPONSES_TOOLS)
        return [first, second, third], session.to_sample()

    (first, second, third), sample = on_endpoint(tool_model, converse)
    (call,) = first.output
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "add", {"a": 2, "b": 3})
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and first.status == "completed"
    assert (second.output_text, third.output_text) == ("5", "5")
    assert second.previous_response_id == first.id and second.output[0].type == "message"
    assert [r.usage.output_tokens for r in (first, second, third)] == model_turns(sample)
    assert first.usage.input_tokens == sample.prompt_tokens
    assert_is_the_taught_episode(sample, teach)


@pytest.mark.integration
def test_a_streamed_responses_episode_is_the_one_answered_whole(taught) -> None:
    """The events a Responses stream sends, numbered from 0, accumulate (in the client's own stream helper) into the
    response answered whole; a client that keeps its own state sends the earlier output items back instead of
    `previous_response_id`, and the sample is the same tokens."""
    tool_model, teach = taught

    async def converse(served: OpenAIEndpoint, context: RolloutContext) -> tuple[Any, list[Any], Any, Sample]:
        session = ChatSession(context, eval_group(), 0)
        async with openai.AsyncOpenAI(base_url=served.open(session), api_key="x", max_retries=0) as client:
            async with client.responses.stream(model="tiny", input=ASK, tools=RESPONSES_TOOLS) as stream:
                first = await stream.get_final_response()
            history = [{"role": "user", "content": ASK},
                       *[item.model_dump(exclude_none=True) for item in first.output],
                       {"type": "function_call_output", "call_id": first.output[0].call_id, "output": "5"}]
            events = [event async for event in await client.responses.create(
                model="tiny", input=history, tools=RESPONSES_TOOLS, stream=True)]
            second = events[-1].response
            history += [item.model_dump(exclude_none=True) for item in second.output]
            third = await client.responses.create(model="tiny", tools=RESPONSES_TOOLS, stream=False,
                                                  input=[*history, {"role": "user", "content": REVIEW}])
        return first, events, third, session.to_sample()

    first, events, third, sample = on_endpoint(tool_model, converse)
    (call,) = first.output
    assert (call.name, json.loads(call.arguments)) == ("add", {"a": 2, "b": 3})
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert [event.type for event in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert events[0].response.status == "in_progress" and events[-1].response.output_text == "5"
    assert "".join(event.delta for event in events if event.type == "response.output_text.delta") == "5"
    assert third.output_text == "5"
    assert_is_the_taught_episode(sample, teach)


@pytest.mark.integration
def test_a_streamed_anthropic_turn_is_the_one_answered_whole(tool_model: Path) -> None:
    """The second turn streamed, raw (event by event) and through the client's stream helper, on two sessions of
    the same conversation: the same message, and the usage of the turn's tokens."""

    async def converse(served: OpenAIEndpoint, context: RolloutContext) -> tuple[list[Any], list[Any], Sample]:
        session = ChatSession(context, eval_group(), 0)
        base_url = served.open(session).removesuffix("/v1")
        async with anthropic.AsyncAnthropic(base_url=base_url, api_key="any", max_retries=0) as client:
            messages: list[dict[str, Any]] = [{"role": "user", "content": ASK}]
            first = await client.messages.create(model="tiny", max_tokens=100, messages=messages,
                                                 tools=ANTHROPIC_TOOLS)
            (use,) = first.content
            messages += [{"role": "assistant", "content": first.content},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                       "content": [{"type": "text", "text": "5"}]}]}]
            raw = [event async for event in await client.messages.create(
                model="tiny", max_tokens=100, messages=messages, tools=ANTHROPIC_TOOLS, stream=True)]
        twin = ChatSession(context, eval_group(), 0)
        async with anthropic.AsyncAnthropic(base_url=served.open(twin).removesuffix("/v1"), api_key="any",
                                            max_retries=0) as client:
            async with client.messages.stream(model="tiny", max_tokens=100, messages=messages[:1],
                                              tools=ANTHROPIC_TOOLS) as stream:
                again = await stream.get_final_message()
            async with client.messages.stream(model="tiny", max_tokens=100, messages=messages,
                                              tools=ANTHROPIC_TOOLS) as stream:
                second = await stream.get_final_message()
        assert twin.to_sample().tokens.tolist() == session.to_sample().tokens.tolist()
        return [first, again, second], raw, session.to_sample()

    (first, again, second), raw, sample = on_endpoint(tool_model, converse)
    (use,) = first.content
    assert (use.type, use.name, use.input, first.stop_reason) == ("tool_use", "add", {"a": 2, "b": 3}, "tool_use")
    assert use.id.startswith("call_") and [first.usage.output_tokens, 2] == model_turns(sample)
    assert again.model_dump(exclude={"id"}) == first.model_dump(exclude={"id"})
    assert [event.type for event in raw] == ["message_start", "content_block_start", "content_block_delta",
                                             "content_block_stop", "message_delta", "message_stop"]
    assert raw[2].delta.text == "5" and raw[4].delta.stop_reason == "end_turn"
    assert (second.content[0].text, second.stop_reason, second.stop_sequence) == ("5", "end_turn", None)
    assert second.usage.output_tokens == raw[4].usage.output_tokens == 2


@pytest.mark.integration
def test_an_anthropic_episode_is_the_taught_conversation_token_for_token(taught) -> None:
    tool_model, teach = taught

    async def converse(served: OpenAIEndpoint, context: RolloutContext) -> tuple[list[Any], Sample]:
        session = ChatSession(context, eval_group(), 0)
        async with anthropic.AsyncAnthropic(base_url=served.open(session).removesuffix("/v1"), api_key="any",
                                            max_retries=0) as client:
            messages: list[dict[str, Any]] = [{"role": "user", "content": ASK}]
            replies = []
            for follow in ("tool", REVIEW, None):
                reply = await client.messages.create(model="tiny", max_tokens=100, messages=messages,
                                                     tools=ANTHROPIC_TOOLS)
                replies.append(reply)
                messages.append({"role": "assistant", "content": reply.content})
                if follow == "tool":
                    messages.append({"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": reply.content[0].id, "content": "5"}]})
                elif follow is not None:
                    messages.append({"role": "user", "content": follow})
        return replies, session.to_sample()

    replies, sample = on_endpoint(tool_model, converse)
    assert [reply.stop_reason for reply in replies] == ["tool_use", "end_turn", "end_turn"]
    assert [reply.usage.output_tokens for reply in replies] == model_turns(sample)
    assert_is_the_taught_episode(sample, teach)


@pytest.mark.integration
def test_length_and_stop_sequences_end_turns_as_each_api_says(tool_model: Path) -> None:
    """A stop sequence's text stays in the turn (the model wrote it; it trains), and Anthropic names the one hit."""

    async def converse(served: OpenAIEndpoint, context: RolloutContext) -> list[Any]:
        replies = []
        urls = [served.open(ChatSession(context, eval_group(), 0)) for _ in range(3)]
        async with openai.AsyncOpenAI(base_url=urls[0], api_key="x", max_retries=0) as client:
            replies.append(await client.responses.create(model="tiny", input=ASK, max_output_tokens=3))
        async with anthropic.AsyncAnthropic(base_url=urls[1].removesuffix("/v1"), api_key="x", max_retries=0) as a:
            replies.append(await a.messages.create(model="tiny", max_tokens=3, messages=[{"role": "user",
                                                                                          "content": ASK}]))
        async with anthropic.AsyncAnthropic(base_url=urls[2].removesuffix("/v1"), api_key="x", max_retries=0) as a:
            replies.append(await a.messages.create(model="tiny", max_tokens=100, stop_sequences=["zzz", "add"],
                                                   messages=[{"role": "user", "content": ASK}]))
        return replies

    cut, capped, stopped = on_endpoint(tool_model, converse)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output[0].status == "incomplete" and cut.output_text == CALL[:3] and cut.usage.output_tokens == 3
    assert (capped.stop_reason, capped.content[0].text) == ("max_tokens", CALL[:3])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "add")
    assert stopped.content[0].text == CALL[:CALL.index("add") + 3]


@pytest.mark.integration
def test_a_rewritten_history_is_refused_naming_the_item_and_the_session_goes_on(taught) -> None:
    """--agent-context-rewrite refuse: the older answer to a rewritten context, kept for those who want it."""
    tool_model, teach = taught

    async def converse(served: OpenAIEndpoint, context: RolloutContext) -> Sample:
        responses_session, anthropic_session = (ChatSession(context, eval_group(), 0) for _ in range(2))
        async with openai.AsyncOpenAI(base_url=served.open(responses_session), api_key="x", max_retries=0) as client:
            first = await client.responses.create(model="tiny", input=ASK, tools=RESPONSES_TOOLS)
            (call,) = [item.model_dump(exclude_none=True) for item in first.output]
            answer = {"type": "function_call_output", "call_id": call["call_id"], "output": "5"}
            for item, expected in [({**call, "arguments": '{"a": 2, "b": 4}'}, r"input\[1\] \(function_call\): "
                                                                                r"message 1 \(assistant\) differs"),
                                   ({"role": "user", "content": "3+3="}, r"input\[0\] \(message\): message 0")]:
                history = [{"role": "user", "content": ASK}, call, answer]
                history[1 if "arguments" in item else 0] = item
                with pytest.raises(openai.BadRequestError, match=expected):
                    await client.responses.create(model="tiny", input=history, tools=RESPONSES_TOOLS)
            with pytest.raises(openai.BadRequestError, match="'previous_response_id' 'resp_gone' is not a response "
                                                             "of this session"):
                await client.responses.create(model="tiny", previous_response_id="resp_gone", input=[answer])
            with pytest.raises(openai.BadRequestError, match=r"instructions: message 0 \(user\) differs"):
                await client.responses.create(model="tiny", previous_response_id=first.id, input=[answer],
                                              instructions="be brief")
            await client.responses.create(model="tiny", previous_response_id=first.id, input=[answer])
        base_url = served.open(anthropic_session).removesuffix("/v1")
        async with anthropic.AsyncAnthropic(base_url=base_url, api_key="x", max_retries=0) as client:
            ask = [{"role": "user", "content": ASK}]
            first = await client.messages.create(model="tiny", max_tokens=100, messages=ask, tools=ANTHROPIC_TOOLS)
            (use,) = first.content
            wrong = {"type": "tool_use", "id": use.id, "name": "add", "input": {"a": 3, "b": 3}}
            result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]}
            with pytest.raises(anthropic.BadRequestError, match=r"messages\[1\]: message 1 \(assistant\) differs") \
                    as refused:
                await client.messages.create(model="tiny", max_tokens=100, tools=ANTHROPIC_TOOLS,
                                             messages=[*ask, {"role": "assistant", "content": [wrong]}, result])
            assert refused.value.body["error"]["type"] == "invalid_request_error"
        return responses_session.to_sample()

    sample = on_endpoint(tool_model, converse, agent_context_rewrite="refuse")
    assert sample.metadata["turns"] == 2 and sample.tokens.tolist() == teach.tokens[:len(sample.tokens)].tolist()


@pytest.mark.integration
async def test_what_the_apis_ask_for_that_is_not_served_is_refused_naming_the_field(endpoint) -> None:
    served, context = endpoint
    url = served.open(ChatSession(context, eval_group(), 0))
    async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0) as client:
        for bad, expected in [
            ({"tools": [{"type": "web_search"}]}, r"tools\[0\]: only function tools .* got 'web_search'"),
            ({"tool_choice": "required"}, "'tool_choice' 'required' is not served"),
            ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
             r"input\[0\] \(message\), content part 0: only text parts"),
            ({"input": [{"type": "reasoning", "summary": []}]}, r"input\[0\] \(reasoning\): input items of type"),
            ({"max_output_tokens": 0}, "'max_output_tokens' must be a positive integer"),
            ({"text": {"format": {"type": "json_object"}}}, "'text.format'"),
        ]:
            with pytest.raises(openai.BadRequestError, match=expected):
                await client.responses.create(model="tiny", **{"input": ASK, **bad})
    async with anthropic.AsyncAnthropic(base_url=url.removesuffix("/v1"), api_key="x", max_retries=0) as client:
        for bad, expected in [
            ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, r"tools\[0\]: only custom tools"),
            ({"tool_choice": {"type": "any"}}, "'tool_choice' .* is not served"),
            ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
             r"messages\[0\], content block 0: a user message holds text and tool_result blocks"),
            ({"messages": [{"role": "system", "content": "x"}]}, r"messages\[0\]: 'role' must be"),
        ]:
            with pytest.raises(anthropic.BadRequestError, match=expected):
                await client.messages.create(model="tiny", **{"max_tokens": 4, "messages": [
                    {"role": "user", "content": ASK}], **bad})
    async with aiohttp.ClientSession() as http, http.post(f"{url}/messages", json={
            "model": "tiny", "messages": [{"role": "user", "content": ASK}]}) as response:
        assert response.status == 400 and await response.json() == {"type": "error", "error": {
            "type": "invalid_request_error",
            "message": "'max_tokens' is required (the Messages API asks every request for it)"}}


@pytest.mark.integration
async def test_a_path_or_method_not_served_answers_an_error_of_its_apis_shape_naming_what_is() -> None:
    """These were aiohttp's plain-text `404: Not Found`, which neither client could read."""
    served = OpenAIEndpoint(model="tiny")
    await served.start()
    try:
        url = f"http://127.0.0.1:{served.port}/sessions/0123456789abcdef/v1"
        async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0) as client:
            with pytest.raises(openai.NotFoundError) as missing:
                await client.embeddings.create(model="tiny", input="x")
        error = missing.value.body
        assert error["type"] == "invalid_request_error"
        assert error["message"].startswith("POST /sessions/0123456789abcdef/v1/embeddings is not served here. Under "
                                           "a session's base URL (/sessions/SESSION/v1) this endpoint serves POST "
                                           "/chat/completions (OpenAI),")
        assert "POST /responses (OpenAI Responses)" in error["message"] and "POST /messages (Anthropic)" in \
            error["message"]
        async with anthropic.AsyncAnthropic(base_url=url.removesuffix("/v1"), api_key="x", max_retries=0) as client:
            with pytest.raises(anthropic.NotFoundError) as missing:
                await client.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": ASK}])
            assert missing.value.body["type"] == "error"
            assert missing.value.body["error"]["type"] == "not_found_error"
            assert "/v1/messages/count_tokens is not served here" in missing.value.body["error"]["message"]
            with pytest.raises(anthropic.NotFoundError, match="no session '0123456789abcdef'"):
                await client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": ASK}])
        async with anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0) as client:
            with pytest.raises(anthropic.NotFoundError, match=r"give it episode\.anthropic_base_url"):
                await client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": ASK}])
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{url}/chat/completions") as response:
                assert response.status == 405
                assert (await response.json())["error"]["message"] == (
                    "GET /sessions/0123456789abcdef/v1/chat/completions is not served: that path takes POST")
            async with http.post(f"http://127.0.0.1:{served.port}/v1/responses", json={}) as response:
                assert response.status == 404
                assert "every call goes under a session's base URL" in (await response.json())["error"]["message"]
            async with http.get(f"{url}/models", headers={"anthropic-version": "2023-06-01"}) as response:
                assert (await response.json())["data"] == [{"type": "model", "id": "tiny", "display_name": "tiny",
                                                            "created_at": "1970-01-01T00:00:00Z"}]
    finally:
        await served.stop()


@pytest.fixture(scope="module")
def two_calls_model(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model taught an episode that calls a tool in two turns in a row."""
    return teach_conversation(tiny_model_path, TWO_CALLS, tmp_path_factory.mktemp("two_calls_model"))[0]


@pytest.mark.integration
def test_tool_call_ids_are_unique_across_turns_and_samples_and_still_match_when_sent_back(
        two_calls_model: Path) -> None:
    """They were `call_0` in every turn of every sample. Two samples, each calling in two turns (Anthropic's client,
    which sends every id back as the `tool_use` block's and its result's): four ids, and the episodes go on."""

    async def converse(served: OpenAIEndpoint, context: RolloutContext) -> tuple[list[str], list[Sample]]:
        sessions = [ChatSession(context, eval_group(2), index) for index in range(2)]
        ids = []
        for session in sessions:
            async with anthropic.AsyncAnthropic(base_url=served.open(session).removesuffix("/v1"), api_key="x",
                                                max_retries=0) as client:
                messages: list[dict[str, Any]] = [{"role": "user", "content": TWO_CALLS[0]["content"]}]
                for result in ("1", "2", None):
                    reply = await client.messages.create(model="tiny", max_tokens=100, messages=messages)
                    messages.append({"role": "assistant", "content": reply.content})
                    if result is not None:
                        (use,) = reply.content
                        ids.append(use.id)
                        messages.append({"role": "user", "content": [
                            {"type": "tool_result", "tool_use_id": use.id, "content": result}]})
            assert reply.content[0].text == "2"
        return ids, [session.to_sample() for session in sessions]

    ids, samples = on_endpoint(two_calls_model, converse)
    assert len(set(ids)) == 4, ids
    assert [sample.metadata["turns"] for sample in samples] == [3, 3]


@pytest.mark.integration
def test_a_call_to_a_tool_the_request_did_not_declare_is_returned_and_counted(tool_model: Path) -> None:
    """OpenAI-compatible servers return what the model called; the agent answers it (with an error, say). The
    sample counts it, so the run sees a policy that invents tools (`multiturn/undeclared_tool_calls_mean`)."""
    declared_elsewhere = [{**ANTHROPIC_TOOLS[0], "name": "subtract"}]

    async def converse(served: OpenAIEndpoint, context: RolloutContext) -> tuple[Any, Sample]:
        session = ChatSession(context, eval_group(), 0)
        async with anthropic.AsyncAnthropic(base_url=served.open(session).removesuffix("/v1"), api_key="x",
                                            max_retries=0) as client:
            reply = await client.messages.create(model="tiny", max_tokens=100, tools=declared_elsewhere,
                                                 messages=[{"role": "user", "content": ASK}])
        return reply, session.to_sample()

    reply, sample = on_endpoint(tool_model, converse)
    assert (reply.stop_reason, reply.content[0].name) == ("tool_use", "add")
    assert sample.metadata["undeclared_tool_calls"] == 1 and sample.metadata["turns"] == 1


@pytest.mark.integration
@pytest.mark.parametrize("agent", ["examples.responses_agent:solve", "examples.anthropic_agent:solve"])
def test_the_example_agents_on_each_api_drive_one_sample_per_episode(tool_model: Path, agent: str) -> None:
    config = run_config(tool_model, agent_function_path=agent)
    runner = agent_generate_for(config)
    assert isinstance(runner, AgentRunner)
    samples = asyncio.run(with_context(tool_model, config, served_episodes(runner, n_samples=2)))
    for sample in samples:
        seen, trained = texts(tool_model, sample)
        assert seen == TAUGHT_TEXT and trained == f"{CALL}<|im_end|>5<|im_end|>5<|im_end|>"
        assert sample.metadata["final_answer"] == "5" and sample.metadata["tool_rounds"] == 1
    assert not runner.endpoint.sessions, "an episode's session outlived it"


@pytest.mark.integration
def test_tools_a_chat_template_leaves_out_are_stated_in_the_system_message_once_said(smollm2_path: Path) -> None:
    """SmolLM2's template renders the same with and without `tools`: they used to vanish (no tool calls in 80
    episodes). Now the prompt states them in the format the parser reads back, after the client's own system text,
    and the worker's log says so once however many sessions do it; the client's conversation is its own, so it
    continues as sent. (With `--no-agent-describe-tools`, as `run_config` sets it, the taught tiny model's episodes
    above are the taught tokens exactly: no description reached their prompts.)"""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    assert not template_renders_tools(tokenizer, CHAT_TOOLS)
    ask = [{"role": "system", "content": "Be exact."}, {"role": "user", "content": ASK}]

    async def converse() -> Sample:
        engine = TorchEngine.from_pretrained(smollm2_path, max_batch_size=2)
        served = OpenAIEndpoint(model="smol")
        await served.start()
        try:
            settings = {"hf_checkpoint": str(smollm2_path), "eval_temperature": 0.0, "agent_describe_tools": True}
            # A session whose prompt does not fit: described (and said) before the engine is asked, at no cost.
            cramped = RolloutContext(engine=engine, tokenizer=tokenizer, worker_id="w",
                                     config=build_config({**settings, "rollout_max_context_len": 50}))
            async with openai.AsyncOpenAI(base_url=served.open(ChatSession(cramped, eval_group(), 0)), api_key="x",
                                          max_retries=0) as client:
                with pytest.raises(openai.BadRequestError, match="leaves no room"):
                    await client.chat.completions.create(model="smol", messages=ask, tools=CHAT_TOOLS)
            context = RolloutContext(engine=engine, tokenizer=tokenizer, worker_id="w", config=build_config(settings))
            session = ChatSession(context, eval_group(), 0)
            async with openai.AsyncOpenAI(base_url=served.open(session), api_key="x", max_retries=0) as client:
                first = await client.chat.completions.create(model="smol", messages=ask, tools=CHAT_TOOLS,
                                                             max_tokens=1)
                answered = first.choices[0].message.model_dump(exclude_none=True)
                await client.chat.completions.create(model="smol", tools=CHAT_TOOLS, max_tokens=1, messages=[
                    *ask, answered, {"role": "user", "content": "?"}])
            return session.to_sample()
        finally:
            await served.stop()
            await engine.close()

    with structlog.testing.capture_logs() as logs:
        sample = asyncio.run(converse())
    prompt = tokenizer.decode(sample.tokens[:sample.prompt_tokens].tolist())
    described = describe_tools(CHAT_TOOLS)
    assert prompt == (f"<|im_start|>system\nBe exact.\n\n{described}<|im_end|>\n<|im_start|>user\n2+3=<|im_end|>\n"
                      "<|im_start|>assistant\n")
    assert sample.metadata["turns"] == 2
    told = [entry for entry in logs if "leaves tools out of the prompt" in entry["event"]]
    assert len(told) == 1 and told[0]["tokenizer"] == str(tokenizer.name_or_path)


@pytest.mark.unit
def test_tools_are_described_only_where_the_template_leaves_them_out_and_as_the_parser_reads_them() -> None:
    from tests.actors.test_trajectory import CHATML
    from tools.standins.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.chat_template = CHATML  # renders `tools` in a system turn of its own, as Qwen's does
    assert template_renders_tools(tokenizer, CHAT_TOOLS)
    described = describe_tools(CHAT_TOOLS)
    assert with_tools_described([{"role": "user", "content": ASK}], CHAT_TOOLS) == [
        {"role": "system", "content": described}, {"role": "user", "content": ASK}]
    assert f"<tools>\n{json.dumps(CHAT_TOOLS[0])}\n</tools>" in described
    # The call format the description gives, filled in, is one the parser reads.
    example = described[described.rindex("<tool_call>"):].replace(
        "<function name>", '"add"').replace("<the arguments as a JSON object>", '{"a": 2, "b": 3}')
    assert parse_tool_calls(example).calls[0].arguments == {"a": 2, "b": 3}
