"""tools/agent_demo.py (#58): each surface's GRPO run is the launcher command it means, the surfaces differ in how
their episodes run and in nothing else, and the client agents' warm start is the conversation they hold, down to
the prompt each API renders for SmolLM2. A short demo through one surface: tests/system/test_agent_run.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from actors.config import build_config, config_from_args
from actors.config.run import RunConfig
from actors.rollout.chat_session import ChatSession
from actors.rollout.generate import RolloutContext
from actors.rollout.openai_endpoint import OpenAIEndpoint
from actors.rollout.sft import sft_generate
from bus.schema import PromptGroup
from engines.inference.torch_engine import TorchEngine
from examples.anthropic_agent import TOOLS as ANTHROPIC_TOOLS
from examples.openai_agent import REVIEW
from examples.openai_agent import TOOLS as CHAT_TOOLS
from examples.responses_agent import TOOLS as RESPONSES_TOOLS
from examples.tool_arithmetic import make_tool_task_data
from launcher import build_parser
from policies.plugins import load_object
from tools.agent_demo import AGENTS, APIS, RECIPES, SMOLLM2, grpo_command


def configured(api: str, recipe: str, tmp_path: Path) -> RunConfig:
    data = {"train": tmp_path / "train.jsonl", "eval": tmp_path / "eval.jsonl"}
    command = grpo_command(api, RECIPES[recipe], tmp_path / "run", tmp_path / "warm", data, steps=8)
    return config_from_args(build_parser().parse_args(command))


@pytest.mark.unit
@pytest.mark.parametrize("recipe", tuple(RECIPES))
def test_each_surface_runs_its_example_agent_and_every_other_setting_is_the_same(recipe: str,
                                                                                 tmp_path: Path) -> None:
    configs = {api: configured(api, recipe, tmp_path) for api in APIS}
    described = RECIPES[recipe].describes_tools
    loop = configs["loop"].agent
    assert loop.agent_tools_path == "examples.tool_arithmetic:FUNCTIONS" and loop.agent_function_path is None
    # the loop hands the template the tools the agents declare where the model is to be told of them
    assert loop.agent_tool_schemas_path == ("examples.openai_agent:TOOLS" if described else None)
    for api, agent in AGENTS.items():
        config = configs[api].agent
        assert config.agent_function_path == agent and config.agent_tools_path is None
        assert config.agent_describe_tools == described
        assert callable(load_object(agent, what="agent function"))
    assert sorted(path.split(":")[0] for path in AGENTS.values()) == [
        "examples.anthropic_agent", "examples.openai_agent", "examples.responses_agent"]
    others = [config.model_dump(exclude={"agent"}) for config in configs.values()]
    assert all(other == others[0] for other in others[1:]), "the surfaces' runs differ beyond their episodes"
    responses = configs["responses"]
    assert responses.eval.eval_temperature == 0 and responses.seed == 1234
    assert responses.eval.eval_interval == 8 // RECIPES[recipe].eval_rounds


@pytest.mark.unit
def test_the_client_agents_warm_start_ends_each_episode_with_the_check_they_ask_for(tmp_path: Path) -> None:
    loop = make_tool_task_data(tmp_path / "loop", eval_size=20, sft_size=40)
    agents = make_tool_task_data(tmp_path / "agents", eval_size=20, sft_size=40, review=REVIEW)
    for name in ("train", "eval"):
        assert loop[name].read_text() == agents[name].read_text(), f"{name}: every surface learns the same pairs"
    for before, after in zip(loop["sft"].read_text().splitlines(), agents["sft"].read_text().splitlines(),
                             strict=True):
        short, long = json.loads(before), json.loads(after)
        assert long["input"] == short["input"]
        assert long["label"] == [*short["label"], {"role": "user", "content": REVIEW}, short["label"][-1]]


@pytest.mark.integration
def test_smollm2s_warm_start_is_taught_the_prompt_each_api_renders_for_its_example_agents_tools(
        smollm2_path: Path, tmp_path: Path) -> None:
    """SmolLM2's template leaves tools out, so the endpoint states them in the system message; its SFT prompts must
    carry that text exactly, whichever API's tools (three spellings of one schema) the agent sent."""
    from transformers import AutoTokenizer

    row = json.loads(make_tool_task_data(tmp_path, eval_size=1, sft_size=1, phrasing=SMOLLM2.phrasing,
                                         review=REVIEW)["sft"].read_text())
    question = row["input"][-1]["content"]

    async def prompts() -> dict[str, list[int]]:
        engine = TorchEngine.from_pretrained(smollm2_path, max_batch_size=2)
        endpoint = OpenAIEndpoint(model="smol")
        await endpoint.start()
        context = RolloutContext(engine=engine, tokenizer=AutoTokenizer.from_pretrained(smollm2_path),
                                 worker_id="w", config=build_config({"hf_checkpoint": str(smollm2_path),
                                                                     "eval_temperature": 0.0}))
        try:
            (taught,) = await sft_generate(context, PromptGroup(group_id="sft", prompt=row["input"],
                                                                label=row["label"], n_samples=1))
            found = {"sft": taught.tokens[:taught.prompt_tokens].tolist()}
            for api in AGENTS:
                session = ChatSession(context, PromptGroup(group_id=api, prompt=question, label="", n_samples=1,
                                                           is_eval=True), 0)
                await first_call(api, endpoint.open(session), [{"role": "user", "content": question}])
                sample = session.to_sample()
                found[api] = sample.tokens[:sample.prompt_tokens].tolist()
            return found
        finally:
            await endpoint.stop()
            await engine.close()

    found = asyncio.run(prompts())
    assert {api: found[api] == found["sft"] for api in AGENTS} == {api: True for api in AGENTS}


async def first_call(api: str, base_url: str, messages: list[dict[str, Any]]) -> None:
    """The example agent's first request, cut to one token."""
    if api == "anthropic":
        async with anthropic.AsyncAnthropic(base_url=base_url.removesuffix("/v1"), api_key="x",
                                            max_retries=0) as claude:
            await claude.messages.create(model="smol", max_tokens=1, messages=messages, tools=ANTHROPIC_TOOLS)
        return
    async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
        if api == "responses":
            await client.responses.create(model="smol", input=messages, tools=RESPONSES_TOOLS, max_output_tokens=1)
        else:
            await client.chat.completions.create(model="smol", messages=messages, tools=CHAT_TOOLS, max_tokens=1)
