"""A dataset record's tools (`--tool-key`, slime's flag): read with the record, carried by its group over the wire,
and given to the chat template when the rollout worker renders the prompt; where the template leaves tools out,
stated in the system message. Bad tool definitions are named by line and the record skipped."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from actors.buffer.core import BufferCore
from actors.config import build_config
from actors.data.prompt_tokens import encode_prompt, prompt_length_counter
from actors.data.prompts import PromptSource, load_prompts
from actors.data.tool_prompts import describe_tools, template_renders_tools
from actors.rollout.agent import AgentRunner, Episode, agent_generate_for
from actors.rollout.generate import RolloutContext
from bus.codec import decode, encode
from bus.schema import PromptGroup, Sample
from tests.actors.test_trajectory import CHATML
from tools.standins.tiny_model import build_tokenizer

TOOLS = [{"type": "function", "function": {"name": "add", "description": "adds two integers",
                                           "parameters": {"type": "object", "properties": {
                                               "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
ASK = [{"role": "user", "content": "2+3="}]


def write_rows(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def chatml_tokenizer() -> Any:
    tokenizer = build_tokenizer()
    tokenizer.chat_template = CHATML  # renders `tools` in a system turn of its own, as Qwen's does
    return tokenizer


@pytest.mark.unit
def test_records_carry_their_tools_and_bad_ones_are_named_by_line(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "p.jsonl", [
        {"input": ASK, "label": "5", "tools": TOOLS},
        {"input": ASK, "label": "5", "tools": json.dumps(TOOLS)},  # as Parquet files often hold them
        {"input": ASK, "label": "5"},  # tools are optional per record
        {"input": ASK, "label": "5", "tools": {"name": "add"}},
        {"input": "2+3=", "label": "5", "tools": TOOLS},  # plain text, no chat template: nowhere to put them
        {"input": ASK, "label": "5", "tools": "[{not json"},
    ])
    records, report = load_prompts(path, tool_key="tools")
    assert [record.tools for record in records] == [TOOLS, TOOLS, None]
    assert [problem.removeprefix(f"{path} ") for problem in report.skipped] == [
        "line 4: key 'tools': expected a list of tool definitions (objects), got dict",
        "line 5: key 'tools': tools reach the model through the chat template, and this prompt is plain text with "
        "--apply-chat-template off",
        "line 6: key 'tools': a string that is not JSON (Expecting property name enclosed in double quotes)"]
    # with the chat template on, a plain-text prompt takes its tools too; without a tool key none are read
    records, _ = load_prompts(path, tool_key="tools", chat_template=True)
    assert records[3].prompt == "2+3=" and records[3].tools == TOOLS
    assert all(record.tools is None for record in load_prompts(path, tool_key=None)[0])


@pytest.mark.unit
def test_the_prompt_holds_the_tools_as_the_template_renders_them_or_as_the_system_message_states_them(
        smollm2_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = chatml_tokenizer()
    assert template_renders_tools(tokenizer, TOOLS)
    with_tools = encode_prompt(tokenizer, ASK, chat_template=True, tools=TOOLS)
    assert with_tools == list(tokenizer.apply_chat_template(ASK, tools=TOOLS, add_generation_prompt=True)["input_ids"])
    assert len(with_tools) > len(encode_prompt(tokenizer, ASK, chat_template=True))

    smollm2 = AutoTokenizer.from_pretrained(smollm2_path)  # its template drops `tools`
    assert not template_renders_tools(smollm2, TOOLS)
    stated = smollm2.decode(encode_prompt(smollm2, ASK, chat_template=True, tools=TOOLS))
    assert stated.startswith(f"<|im_start|>system\n{describe_tools(TOOLS)}<|im_end|>\n<|im_start|>user\n2+3=")
    unstated = encode_prompt(smollm2, ASK, chat_template=True, tools=TOOLS, describe_ignored_tools=False)
    assert unstated == encode_prompt(smollm2, ASK, chat_template=True)
    with pytest.raises(ValueError, match="--apply-chat-template"):
        encode_prompt(smollm2, "2+3=", chat_template=False, tools=TOOLS)


@pytest.mark.unit
def test_a_leased_group_brings_its_records_tools_over_the_wire_to_the_rollout_workers_prompt(
        tmp_path: Path) -> None:
    path = write_rows(tmp_path / "p.jsonl", [{"input": ASK, "label": "5", "tools": TOOLS}])
    config = build_config({"prompt_data": str(path), "rollout_max_prompt_len": 512})
    assert config.data.tool_key == "tools"  # slime's default
    tokenizer = chatml_tokenizer()
    count = prompt_length_counter(config, tokenizer)
    records, _ = load_prompts(path, tool_key=config.data.tool_key, max_prompt_len=512, count_tokens=count)
    core = BufferCore(source=PromptSource(records, seed=1), n_samples=2, groups_per_batch=1, max_staleness=0,
                      lease_timeout=10.0)
    leased = core.lease("rollout-0-0", max_groups=1)
    assert leased is not None
    [group] = [decode(encode(group)) for group in leased[1]]  # as the rollout worker receives it
    assert group.tools == TOOLS
    context = RolloutContext(engine=None, tokenizer=tokenizer, config=config, worker_id="w")  # type: ignore[arg-type]
    ids = context.prompt_ids(group.prompt, group.tools)
    assert ids == list(tokenizer.apply_chat_template(ASK, tools=TOOLS, add_generation_prompt=True)["input_ids"])
    assert count(group.prompt, group.tools) == len(ids)  # the load-time cap counts what the engine sees


@pytest.mark.unit
def test_slimes_tool_key_flags_are_ours() -> None:
    config = build_config({"tool_key": "functions", "eval_tool_key": "none"})
    assert (config.data.tool_key, config.eval_tool_key) == ("functions", None)
    assert build_config({"tool_key": "none"}).eval_tool_key is None


async def agent_that_offers_its_records_tools(episode: Episode) -> dict[str, Any]:
    """An agent that offers the model the tools its record came with, as a harness reading them from the task
    would."""
    import openai

    async with openai.AsyncOpenAI(base_url=episode.base_url, api_key=episode.api_key, max_retries=0) as client:
        await client.chat.completions.create(model=episode.model, messages=episode.messages, tools=episode.tools,
                                             max_tokens=2)
    return {"offered_tools": [tool["function"]["name"] for tool in episode.tools or []]}


@pytest.mark.integration
def test_an_agent_gets_its_records_tools_with_the_episode(tiny_model_path: Path) -> None:
    from tests.actors.test_agent_episodes import run_config, with_context

    config = run_config(tiny_model_path, agent_function_path=f"{__name__}:agent_that_offers_its_records_tools")
    runner = agent_generate_for(config)
    assert isinstance(runner, AgentRunner)
    group = PromptGroup(group_id="g", prompt="2+3=", label="5", n_samples=1, is_eval=True, tools=TOOLS)

    async def episodes(context: RolloutContext) -> list[Sample]:
        await runner.start()
        try:
            return await runner(context, group)
        finally:
            await runner.stop()

    (sample,) = asyncio.run(with_context(tiny_model_path, config, episodes))
    assert sample.status != "failed", sample.error
    assert sample.metadata["offered_tools"] == ["add"]


@pytest.mark.integration
def test_multi_turn_sft_teaches_the_prompt_with_its_records_tools_as_the_rollout_renders_it(
        tiny_model_path: Path) -> None:
    from transformers import AutoTokenizer

    from actors.rollout.sft import sft_generate
    from engines.inference.torch_engine import TorchEngine

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)  # its template leaves tools out: they are stated
    config = build_config({"hf_checkpoint": str(tiny_model_path), "apply_chat_template": True})
    group = PromptGroup(group_id="g", prompt="2+3=", label=[{"role": "assistant", "content": "5"}], n_samples=1,
                        tools=TOOLS)

    async def taught() -> Sample:
        engine = TorchEngine.from_pretrained(tiny_model_path, max_batch_size=1)
        try:
            context = RolloutContext(engine=engine, tokenizer=tokenizer, config=config, worker_id="w")
            (sample,) = await sft_generate(context, group)
            assert sample.tokens[:sample.prompt_tokens].tolist() == context.prompt_ids(group.prompt, group.tools)
            return sample
        finally:
            await engine.close()

    sample = asyncio.run(taught())
    assert describe_tools(TOOLS) in tokenizer.decode(sample.tokens[:sample.prompt_tokens].tolist())
