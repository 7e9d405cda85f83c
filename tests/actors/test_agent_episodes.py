"""Multi-turn episodes on a real tiny model (#18): the built-in tool loop, and an agent written against the OpenAI
client library driving the rollout worker's endpoint. The model is taught by SFT, in the fixture, to answer "2+3="
with a Hermes `<tool_call>` to `add` and then with the tool's result, so the episodes below are the model's own."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import openai
import pytest

from actors.config import RunConfig, build_config
from actors.learner.episode_metrics import episode_metrics
from actors.learner.step import TrainingStep
from actors.rollout.agent import AgentRunner, EpisodeLoop, agent_generate_for
from actors.rollout.chat_session import ChatSession
from actors.rollout.environment import EnvStep, Turn
from actors.rollout.generate import RolloutContext
from actors.rollout.openai_endpoint import OpenAIEndpoint
from actors.rollout.sft import sft_generate
from actors.rollout.tool_calls import parse_tool_calls
from actors.rollout.tool_environment import FunctionTools, answer_calls
from actors.rollout.trajectory import render
from bus.schema import PromptGroup, Sample
from engines.inference.torch_engine import TorchEngine
from engines.training.config import TorchTrainerConfig
from engines.training.torch_trainer import TorchTrainer
from examples.openai_agent import REVIEW
from examples.python_tool import TOOLS as PYTHON_TOOLS
from policies.rewards import RewardInput
from policies.rewards.episodes import environment_return

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
TROUBLE = "tests.support.agents:one_call_then_trouble"
TEACH = [{"role": "user", "content": "2+3="}, {"role": "assistant", "content": CALL},
         {"role": "tool", "content": "5"}, {"role": "assistant", "content": "5"},
         {"role": "user", "content": REVIEW}, {"role": "assistant", "content": "5"}]


@pytest.fixture(scope="module")
def taught(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Sample]:
    """The tiny model after SFT on one tool-using conversation (a multi-turn SFT label: loss on its turns only),
    and the SFT sample it was taught with."""
    return teach_conversation(tiny_model_path, TEACH, tmp_path_factory.mktemp("tool_model"))


def teach_conversation(base: Path, conversation: list[dict[str, Any]], out: Path) -> tuple[Path, Sample]:
    """`base` taught `conversation` (a user turn, then the episode) by SFT until it has it by heart, saved at
    `out`; and the SFT sample, which is the conversation's tokens as a greedy episode generates them."""
    config = build_config({"hf_checkpoint": str(base), "loss_type": "sft"})
    group = PromptGroup(group_id="teach", prompt=conversation[0]["content"], label=conversation[1:], n_samples=1)
    (teach,) = asyncio.run(with_context(base, config, lambda context: sft_generate(context, group)))
    trainer = TorchTrainer(TorchTrainerConfig(model_path=base, lr=1e-2))
    step = TrainingStep(trainer, config)
    for _ in range(300):
        if step.train([teach], staleness=[0]).metrics["loss"] < 0.003:
            break
    trainer.export_hf(out)
    return out, teach


@pytest.fixture(scope="module")
def tool_model(taught: tuple[Path, Sample]) -> Path:
    return taught[0]


def run_config(model: Path, **settings: Any) -> RunConfig:
    """The tiny model's template leaves tools out, and the taught model calls `add` without being shown it: the
    tools are not described to it (a description would not fit its context either)."""
    from transformers import AutoTokenizer

    im_end = AutoTokenizer.from_pretrained(model).convert_tokens_to_ids("<|im_end|>")
    return build_config({"hf_checkpoint": str(model), "rollout_max_response_len": 80, "eval_temperature": 0.0,
                         "rollout_stop_token_ids": [im_end], "agent_describe_tools": False, **settings})


async def with_context(model: Path, config: RunConfig, body: Callable[[RolloutContext], Awaitable[Any]], *,
                       max_model_len: int | None = None) -> Any:
    from transformers import AutoTokenizer

    engine = TorchEngine.from_pretrained(model, max_batch_size=4, max_model_len=max_model_len)
    try:
        context = RolloutContext(engine=engine, tokenizer=AutoTokenizer.from_pretrained(model), config=config,
                                 worker_id="w")
        return await body(context)
    finally:
        await engine.close()


def served_episodes(runner: AgentRunner, *, n_samples: int) -> Callable[[RolloutContext], Awaitable[list[Sample]]]:
    """One eval group's episodes through the runner's endpoint, started and stopped around them."""

    async def episodes(context: RolloutContext) -> list[Sample]:
        await runner.start()
        try:
            return await runner(context, eval_group(n_samples=n_samples))
        finally:
            await runner.stop()

    return episodes


def eval_group(n_samples: int = 1) -> PromptGroup:
    return PromptGroup(group_id="g", prompt="2+3=", label="5", n_samples=n_samples, is_eval=True)


def texts(model: Path, sample: Sample) -> tuple[str, str]:
    """(the response as the model saw it, special tokens included; the trained tokens' text)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    response = sample.tokens[sample.prompt_tokens:]
    trained = response[np.asarray(sample.loss_mask, dtype=bool)]
    return tokenizer.decode(response.tolist()), tokenizer.decode(trained.tolist())


@pytest.mark.integration
def test_the_tool_loop_answers_the_models_call_and_trains_only_its_turns(taught: tuple[Path, Sample]) -> None:
    """The rollout of the taught conversation is token for token the SFT sample it was taught with: multi-turn SFT
    lays its target out as the tool loop generates into it."""
    tool_model, teach = taught
    config = run_config(tool_model, agent_tools_path="examples.openai_agent:FUNCTIONS",
                        agent_tool_schemas_path="examples.openai_agent:TOOLS", agent_max_turns=2)
    loop = agent_generate_for(config)
    assert isinstance(loop, EpisodeLoop)
    (sample,) = asyncio.run(with_context(tool_model, config, lambda context: loop(context, eval_group())))
    seen, trained = texts(tool_model, sample)
    assert seen == f"{CALL}<|im_end|>\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n5<|im_end|>"
    assert trained == f"{CALL}<|im_end|>5<|im_end|>"
    assert sample.metadata | {"turns": 2, "tool_calls": 1, "tool_errors": 0} == sample.metadata
    assert sample.status == "completed"
    assert len(sample.rollout_log_probs) == len(sample.loss_mask) == sample.response_length
    assert sample.tokens.tolist() == teach.tokens[:len(sample.tokens)].tolist()
    assert sample.loss_mask.tolist() == teach.loss_mask[:sample.response_length].tolist()


@pytest.mark.integration
def test_an_agent_on_the_openai_client_drives_one_sample_per_episode(tool_model: Path) -> None:
    config = run_config(tool_model, agent_function_path="examples.openai_agent:solve")
    runner = agent_generate_for(config)
    assert isinstance(runner, AgentRunner)
    samples = asyncio.run(with_context(tool_model, config, served_episodes(runner, n_samples=2)))
    for sample in samples:
        seen, trained = texts(tool_model, sample)
        assert seen == (f"{CALL}<|im_end|>\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n5<|im_end|>\n"
                        f"<|im_start|>user\n{REVIEW}<|im_end|>\n<|im_start|>assistant\n5<|im_end|>")
        assert trained == f"{CALL}<|im_end|>5<|im_end|>5<|im_end|>"
        assert sample.metadata["final_answer"] == "5" and sample.metadata["tool_rounds"] == 1
        assert sample.metadata["turns"] == 3 and sample.status == "completed"
    assert not runner.endpoint.sessions, "an episode's session outlived it"


@pytest.mark.integration
@pytest.mark.parametrize(("agent", "calls", "errors"), [
    ("tool_answered", 1, 0),
    ("tool_failed_by_its_text", 1, 1),  # "error:" or "Error:" leading the result, as the built-in tools write it
    ("tool_failed_by_its_flag", 1, 1),  # "is_error": true on the tool message (Anthropic's tool_result field)
    ("counts_its_own_tools", 3, 2),  # what the agent returns is what it knows better
])
def test_an_agents_tool_calls_and_errors_are_counted_from_what_its_session_sees(
        tool_model: Path, agent: str, calls: int, errors: int) -> None:
    """`multiturn/tool_calls_mean` and `tool_error_fraction` read 0 for every client-written agent: only the built-in
    loop counted. The taught model calls `add` once per episode; the agent's answer says whether the call failed."""
    config = run_config(tool_model, agent_function_path=f"tests.support.agents:{agent}")
    samples = asyncio.run(with_context(tool_model, config, served_episodes(agent_generate_for(config), n_samples=2)))
    assert [(s.metadata["tool_calls"], s.metadata["tool_errors"]) for s in samples] == [(calls, errors)] * 2
    metrics = episode_metrics(samples)
    assert metrics["multiturn/tool_calls_mean"] == calls and metrics["multiturn/tool_error_fraction"] == errors / calls


@pytest.mark.integration
def test_an_agent_that_reports_counts_that_are_not_counts_fails_its_sample_naming_them(tool_model: Path) -> None:
    config = run_config(tool_model, agent_function_path="tests.support.agents:miscounts_its_tools")
    (sample,) = asyncio.run(with_context(tool_model, config, served_episodes(agent_generate_for(config), n_samples=1)))
    assert sample.status == "failed"
    assert sample.error == ("agent tests.support.agents:miscounts_its_tools failed: ValueError: it returned "
                            "tool_calls='three': the counts an agent reports are integers >= 0")


@pytest.mark.integration
@pytest.mark.parametrize(("flags", "roles"), [
    ({"agent_function_path": "examples.openai_agent:solve"},
     ["user", "assistant", "tool", "assistant", "user", "assistant"]),
    ({"agent_tools_path": "examples.openai_agent:FUNCTIONS", "agent_tool_schemas_path": "examples.openai_agent:TOOLS",
      "agent_max_turns": 2}, ["user", "assistant", "tool", "assistant"]),
], ids=["openai_agent", "tool_loop"])
def test_the_reward_is_given_the_episode_as_chat_messages_with_its_tool_calls(
        tool_model: Path, flags: dict[str, Any], roles: list[str]) -> None:
    """The reward saw the conversation only as text with the template's role names in it; it now also gets the
    messages, as they crossed the wire from the rollout worker, the model's calls as OpenAI tool calls."""
    from bus.codec import decode, encode
    from policies.rewards import reward_input

    config = run_config(tool_model, **flags)
    generate = agent_generate_for(config)
    episodes = (served_episodes(generate, n_samples=1) if isinstance(generate, AgentRunner)
                else lambda context: generate(context, eval_group()))
    (sample,) = asyncio.run(with_context(tool_model, config, episodes))
    given = reward_input(decode(encode(sample)))
    assert given.messages is not None and [m["role"] for m in given.messages] == roles
    assert given.messages[0] == {"role": "user", "content": "2+3="} and given.messages[3]["content"] == "5"
    (call,) = given.messages[1]["tool_calls"]
    assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == {"a": 2, "b": 3}
    assert given.messages[2]["tool_call_id"] == call["id"] and given.messages[2]["content"] == "5"
    assert given.response == sample.response and "5" in given.response  # the text, for rewards that read text


@pytest.mark.integration
def test_an_agent_that_raises_or_overruns_fails_only_its_own_sample(tiny_model_path: Path) -> None:
    config = run_config(tiny_model_path, agent_function_path=TROUBLE, agent_timeout=3)
    runner = agent_generate_for(config)
    assert isinstance(runner, AgentRunner)
    ok, raised, slow = asyncio.run(with_context(tiny_model_path, config, served_episodes(runner, n_samples=3)))
    assert ok.status != "failed" and ok.metadata["turns"] == 1 and ok.error is None
    assert raised.status == "failed"
    assert raised.error == f"agent {TROUBLE} failed: RuntimeError: the sandbox is gone"
    assert slow.status == "failed" and "within --agent-timeout 3 s" in slow.error


@contextlib.asynccontextmanager
async def serving(model: Path, *, max_model_len: int | None = None) -> AsyncIterator[tuple[OpenAIEndpoint,
                                                                                           RolloutContext]]:
    """`model`'s engine behind a started endpoint, and a rollout context on that engine."""
    from transformers import AutoTokenizer

    engine = TorchEngine.from_pretrained(model, max_batch_size=4, max_model_len=max_model_len)
    served = OpenAIEndpoint(model="tiny")
    await served.start()
    context = RolloutContext(engine=engine, tokenizer=AutoTokenizer.from_pretrained(model),
                             config=run_config(model), worker_id="w")
    try:
        yield served, context
    finally:
        await served.stop()
        await engine.close()


@pytest.fixture
async def endpoint(tiny_model_path: Path) -> AsyncIterator[tuple[OpenAIEndpoint, RolloutContext]]:
    async with serving(tiny_model_path) as served:
        yield served


def refusing_rewrites(context: RolloutContext) -> RolloutContext:
    """`context` under --agent-context-rewrite refuse: a call that rewrites the conversation is answered an error."""
    config = context.config
    config = config.model_copy(update={"agent": config.agent.model_copy(update={"agent_context_rewrite": "refuse"})})
    return RolloutContext(engine=context.engine, tokenizer=context.tokenizer, config=config, worker_id="w")


@pytest.mark.integration
async def test_the_endpoint_refuses_what_it_cannot_serve_naming_the_field(endpoint) -> None:
    served, context = endpoint
    url = served.open(ChatSession(refusing_rewrites(context), eval_group(), 0))
    ask = [{"role": "user", "content": "2+3="}]
    async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0) as client:
        first = (await client.chat.completions.create(model="tiny", messages=ask, max_tokens=5)).choices[0].message
        assert first.role == "assistant" and (await client.models.list()).data[0].id == "tiny"
        for bad, expected in [({"n": 2}, "'n' must be 1"),
                              ({"stream_options": {"include_usage": True}}, "only allowed with 'stream': true"),
                              ({"max_tokens": 0}, "'max_tokens' must be a positive integer"),
                              ({"stop": [""]}, "'stop' must be a string or a list of non-empty strings")]:
            with pytest.raises(openai.BadRequestError, match=expected):
                await client.chat.completions.create(model="tiny", messages=ask, **bad)
        rewritten = [*ask, {"role": "assistant", "content": "something else"}, {"role": "user", "content": "?"}]
        with pytest.raises(openai.BadRequestError, match=r"message 1 \(assistant\) differs"):
            await client.chat.completions.create(model="tiny", messages=rewritten)
        with pytest.raises(openai.BadRequestError, match="tools differ from the session's first call"):
            await client.chat.completions.create(model="tiny", messages=[*ask, first.model_dump(exclude_none=True),
                                                                         {"role": "user", "content": "?"}],
                                                 tools=[{"type": "function", "function": {"name": "f"}}])
        with pytest.raises(openai.BadRequestError, match="a text completion needs a session of its own"):
            await client.completions.create(model="tiny", prompt="2+3=")
        # The refusals changed nothing: the conversation goes on from the model's first turn.
        follow = [*ask, first.model_dump(exclude_none=True), {"role": "user", "content": "and 1+1="}]
        await client.chat.completions.create(model="tiny", messages=follow, max_tokens=5)
    gone = url.replace(url.split("/")[-2], "0" * 16)
    async with openai.AsyncOpenAI(base_url=gone, api_key="x", max_retries=0) as client:
        with pytest.raises(openai.NotFoundError, match="no session"):
            await client.chat.completions.create(model="tiny", messages=ask)
    async with aiohttp.ClientSession() as http, http.post(f"{url}/chat/completions", data=b"{not json") as response:
        assert response.status == 400 and "not JSON" in (await response.json())["error"]["message"]
    sample = served.sessions[url.split("/")[-2]].to_sample()
    assert sample.metadata["turns"] == 2


@pytest.mark.integration
def test_a_streamed_conversation_is_the_one_answered_whole(tool_model: Path) -> None:
    """Agent frameworks that always stream get the same turns, as OpenAI's chunks: content, tool calls, finish
    reason, usage. Greedy (an eval group), so a streamed and a whole session must agree exactly."""
    from examples.openai_agent import TOOLS

    async def converse(context: RolloutContext) -> tuple[list[Any], list[Any], Any]:
        served = OpenAIEndpoint(model="tiny")
        await served.start()
        try:
            whole_url, streamed_url = (served.open(ChatSession(context, eval_group(), 0)) for _ in range(2))
            ask = [{"role": "user", "content": "2+3="}]
            async with openai.AsyncOpenAI(base_url=whole_url, api_key="x", max_retries=0) as client:
                whole = (await client.chat.completions.create(model="tiny", messages=ask, tools=TOOLS)).choices[0]
            async with openai.AsyncOpenAI(base_url=streamed_url, api_key="x", max_retries=0) as client:
                chunks = [chunk async for chunk in await client.chat.completions.create(
                    model="tiny", messages=ask, tools=TOOLS, stream=True, stream_options={"include_usage": True})]
            return [whole], chunks, served.sessions[streamed_url.split("/")[-2]].to_sample()
        finally:
            await served.stop()

    config = run_config(tool_model)
    (whole,), chunks, streamed_sample = asyncio.run(with_context(tool_model, config, converse))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    content = "".join(delta.content or "" for delta in deltas)
    calls = [call for delta in deltas for call in delta.tool_calls or []]
    assert whole.finish_reason == "tool_calls" and [c.choices[0].finish_reason for c in chunks if c.choices][-1] \
        == "tool_calls"
    assert content == (whole.message.content or "")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("add", {"a": 2, "b": 3})]
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == streamed_sample.response_length


@pytest.mark.integration
async def test_text_completions_continue_the_sessions_text_token_for_token(endpoint) -> None:
    served, context = endpoint
    session = ChatSession(context, eval_group(), 0)
    url = served.open(session)
    async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0) as client:
        first = (await client.completions.create(model="tiny", prompt="2+3=", max_tokens=4)).choices[0].text
        with pytest.raises(openai.BadRequestError, match="must be the session's text so far"):
            await client.completions.create(model="tiny", prompt="3+3=" + first + " ok", max_tokens=4)
        second = (await client.completions.create(model="tiny", prompt="2+3=" + first + " ok", max_tokens=4))
        streamed = [chunk async for chunk in await client.completions.create(
            model="tiny", prompt="2+3=" + first + " ok" + second.choices[0].text + " ok", max_tokens=4, stream=True)]
    sample = session.to_sample()
    tokens = context.tokenizer("2+3=")["input_ids"]
    assert sample.tokens[:len(tokens)].tolist() == tokens
    assert json.loads(second.model_dump_json())["usage"]["prompt_tokens"] == len(tokens) + 4 + 3
    assert sample.loss_mask.tolist() == [1] * 4 + [0] * 3 + [1] * 4 + [0] * 3 + [1] * 4
    # The streamed third completion is the session's last four tokens, as text, then its finish reason.
    third = "".join(chunk.choices[0].text for chunk in streamed)
    assert third == context.tokenizer.decode(sample.tokens[-4:].tolist())
    assert streamed[-1].choices[0].finish_reason == "length"


@pytest.mark.unit
def test_agent_flags_that_both_generate_are_refused_naming_both() -> None:
    with pytest.raises(ValueError, match="--agent-function-path and --agent-tools-path each run the episode"):
        agent_generate_for(build_config({"agent_function_path": "examples.openai_agent:solve",
                                         "agent_tools_path": "examples.openai_agent:FUNCTIONS"}))
    with pytest.raises(ValueError, match="--custom-generate-function-path and the --agent-"):
        agent_generate_for(build_config({"agent_tools_path": "examples.openai_agent:FUNCTIONS",
                                         "custom_generate_function_path": "examples.calculator_env:"
                                                                          "calculator_generate"}))
    with pytest.raises(TypeError, match="must name a dict of tool name -> function"):
        agent_generate_for(build_config({"agent_tools_path": "examples.openai_agent:TOOLS"}))
    assert agent_generate_for(build_config({})) is None


@pytest.mark.unit
@pytest.mark.parametrize(("label", "expected"), [
    ([{"role": "tool", "content": "5"}, {"role": "assistant", "content": "5"}], "starting and ending with the "
                                                                               "model's turn"),
    ([{"role": "assistant", "content": 5}], "each with a 'role' and a text 'content'"),
    ([], "each with a 'role' and a text 'content'"),
])
def test_a_multi_turn_sft_label_that_is_not_an_episode_is_refused_naming_the_group(label, expected) -> None:
    from actors.rollout.sft import _target_messages

    with pytest.raises(ValueError, match=f"group g7: an SFT label that is a list .*{expected}"):
        _target_messages(PromptGroup(group_id="g7", prompt="p", label=label))


@pytest.mark.integration
@pytest.mark.parametrize("flag", [{"agent_tools_path": "examples.openai_agent:FUNCTIONS"},
                                  {"agent_function_path": "examples.openai_agent:solve"}],
                         ids=["tool_loop", "openai_agent"])
def test_an_episode_that_outgrows_the_models_context_ends_truncated_with_the_turns_it_has(
        tool_model: Path, flag: dict[str, str]) -> None:
    """The taught episode needs about 115 tokens; with a context of 100 the second turn has no room. The sample
    is the first turn (the tool's reply, appended for a turn that never came, dropped) and is marked truncated.
    The agent on the OpenAI client has its second call refused with `context_length_exceeded` and ends there; its
    sample was marked completed, so truncation handling and `multiturn/truncated_fraction` never saw it."""
    config = run_config(tool_model, **flag)
    generate = agent_generate_for(config)
    episodes = (served_episodes(generate, n_samples=1) if isinstance(generate, AgentRunner)
                else lambda context: generate(context, eval_group()))
    (sample,) = asyncio.run(with_context(tool_model, config, episodes, max_model_len=100))
    seen, trained = texts(tool_model, sample)
    assert seen == trained == f"{CALL}<|im_end|>"
    assert sample.status == "truncated" and sample.metadata["turns"] == 1 and sample.metadata["tool_calls"] == 1
    assert len(sample.tokens) < 100


@pytest.mark.integration
def test_a_single_turn_prompt_longer_than_the_context_fails_its_samples_naming_it(tiny_model_path: Path) -> None:
    """It used to raise out of the generate function: the group failed, its lease expired and it was re-issued,
    again and again, to fail the same way on every worker."""
    from transformers import AutoTokenizer

    from actors.rollout.generate import default_generate

    async def generate() -> list[Sample]:
        engine = TorchEngine.from_pretrained(tiny_model_path, max_batch_size=4, max_model_len=12)
        try:
            context = RolloutContext(engine=engine, tokenizer=AutoTokenizer.from_pretrained(tiny_model_path),
                                     config=run_config(tiny_model_path), worker_id="w")
            return await default_generate(context, PromptGroup(group_id="long", prompt="1+1=" * 5, n_samples=2))
        finally:
            await engine.close()

    samples = asyncio.run(generate())
    assert [s.status for s in samples] == ["failed", "failed"]
    assert "prompt of 20 tokens leaves no room in the model's context of 12 tokens" in samples[0].error


class CountdownGame:
    """A stateful environment: the model must say the number it is shown; a right turn earns 1 and shows the next
    number down, any other earns 0; done after three numbers. Its step raises once, on the second turn."""

    def __init__(self, prompt: str, label: object, metadata: dict) -> None:
        self.number, self.turns = 3, 0

    async def reset(self) -> list[dict]:
        return [{"role": "user", "content": f"say {self.number}"}]

    async def step(self, turn: Turn) -> EnvStep:
        self.turns += 1
        if self.turns == 2:
            raise RuntimeError("the board fell over")
        reward = 1.0 if turn.text.strip() == str(self.number) else 0.0
        self.number -= 1
        return EnvStep(messages=[{"role": "user", "content": f"say {self.number}"}], reward=reward,
                       done=self.number == 0)


class UnstartableGame:
    def __init__(self, prompt: str, label: object, metadata: dict) -> None:
        pass

    async def reset(self) -> list[dict]:
        raise ConnectionError("no sandbox left")


class SloppyGame(CountdownGame):
    async def step(self, turn: Turn) -> EnvStep:
        return {"messages": []} if turn.index == 0 else EnvStep(messages=["not a message"], done=True)


@pytest.mark.integration
def test_an_environment_that_cannot_start_fails_its_sample_and_a_sloppy_step_is_shown_to_the_model(
        tiny_model_path: Path) -> None:
    """Neither is the model's doing nor the worker's end: the first fails the sample (counted, with its reason, not
    re-issued to fail again), the second comes back to the model as an error, like a step that raises."""
    one_token = {"rollout_stop_token_ids": list(range(120)), "agent_max_turns": 5}
    config = run_config(tiny_model_path, agent_environment_path=f"{__name__}:UnstartableGame", **one_token)
    (failed,) = asyncio.run(with_context(tiny_model_path, config,
                                         lambda context: agent_generate_for(config)(context, eval_group())))
    assert failed.status == "failed"
    assert failed.error == (f"environment {__name__}:UnstartableGame could not start an episode: ConnectionError: "
                            "no sandbox left")
    config = run_config(tiny_model_path, agent_environment_path=f"{__name__}:SloppyGame", **one_token)
    (sample,) = asyncio.run(with_context(tiny_model_path, config,
                                         lambda context: agent_generate_for(config)(context, eval_group())))
    seen, _ = texts(tiny_model_path, sample)
    assert "error: the environment failed: TypeError: step() returned dict, not an EnvStep" in seen
    assert "error: the environment failed: TypeError: step()'s messages must be chat messages" in seen
    # A step that is refused loses its "done" too: the game runs to --agent-max-turns, every step an error.
    assert sample.metadata["tool_errors"] == 5 and sample.metadata["turns"] == 5


@pytest.mark.integration
def test_an_environment_drives_the_loop_with_state_per_turn_rewards_and_a_step_that_raises(
        tiny_model_path: Path) -> None:
    from transformers import AutoTokenizer

    config = run_config(tiny_model_path, agent_environment_path=f"{__name__}:CountdownGame", agent_max_turns=5,
                        rollout_stop_token_ids=list(range(120)))  # every turn one token, ended by "stop"
    loop = agent_generate_for(config)
    assert isinstance(loop, EpisodeLoop)
    samples = asyncio.run(with_context(tiny_model_path, config, lambda context: loop(context, eval_group(2))))
    for sample in samples:
        seen, _ = texts(tiny_model_path, sample)
        # The untrained model says anything: each rewarded turn earns 0 and counts the game down; the raising
        # second step came back to the model as a message, was counted, and did not count down.
        assert sample.metadata["turns"] == 4 and sample.metadata["turn_rewards"] == [0.0, 0.0, 0.0]
        assert "<|im_start|>user\nerror: the environment failed: RuntimeError: the board fell over" in seen
        assert "<|im_start|>user\nsay 1<|im_end|>" in seen and sample.metadata["tool_errors"] == 1
        prompt = AutoTokenizer.from_pretrained(tiny_model_path).decode(sample.tokens[:sample.prompt_tokens].tolist())
        assert prompt.endswith("<|im_start|>user\nsay 3<|im_end|>\n<|im_start|>assistant\n")
    assert environment_return(RewardInput(prompt="", response="", metadata={"turn_rewards": [1.0, 0.0, 1.0]})) == 2.0


@pytest.mark.integration
async def test_the_sandboxed_python_tool_answers_a_models_calls_and_a_runaway_program_times_out() -> None:
    turn = parse_tool_calls('<tool_call>{"name": "python", "arguments": {"code": "print(2 ** 10)"}}</tool_call>'
                            '<tool_call>{"name": "python", "arguments": {"code": "while True: pass"}}</tool_call>'
                            '<tool_call>{"name": "python", "arguments": {"code": "import os; print(os.environ)"}}'
                            '</tool_call>')
    results = await answer_calls(FunctionTools(PYTHON_TOOLS), turn, timeout_s=10)
    output, runaway, environment = (m["content"] for m in results.messages)
    assert (output, results.errors) == ("1024", 0), results.messages
    assert runaway == "timeout" or runaway.startswith("killed: the program ran past its")  # wall clock or rlimit
    assert environment.startswith("environ(") and "HOME" not in environment and "PATH" not in environment


@pytest.mark.integration
async def test_a_first_call_that_does_not_fit_leaves_the_session_empty_and_usable(tiny_model_path: Path) -> None:
    async with serving(tiny_model_path, max_model_len=48) as (served, context):
        session = ChatSession(context, eval_group(), 0)
        url = served.open(session)
        async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0) as client:
            with pytest.raises(openai.BadRequestError, match="leaves no room") as refused:
                await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "9" * 60}])
            assert refused.value.code == "context_length_exceeded"
            with pytest.raises(ValueError, match="the episode never called the model"):
                session.to_sample()
            await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "1+1="}],
                                                 max_tokens=3)
        sample = session.to_sample()
        assert sample.prompt_tokens == len(render(context.tokenizer, [{"role": "user", "content": "1+1="}],
                                                  add_generation_prompt=True))
        assert sample.response_length == 3
