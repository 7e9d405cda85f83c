"""Tool calls (#18): Hermes/Qwen `<tool_call>` blocks parsed from a model turn, and answered by an episode's tools
without anything a tool or the model does ending the episode."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from actors.rollout.tool_calls import ToolCall, parse_tool_calls
from actors.rollout.tool_environment import FunctionTools, answer_calls

pytestmark = pytest.mark.unit


def test_calls_are_parsed_in_order_with_the_text_around_them() -> None:
    turn = parse_tool_calls('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
                            '<tool_call>{"name": "neg", "arguments": "{\\"x\\": 3}"}</tool_call>')
    assert turn.content == "Let me add."
    assert turn.calls == [ToolCall("add", {"a": 1, "b": 2}, "call_0"), ToolCall("neg", {"x": 3}, "call_1")]
    assert turn.malformed == []


def test_a_turn_without_calls_is_all_content() -> None:
    turn = parse_tool_calls("  The answer is 5.  ")
    assert (turn.content, turn.calls, turn.malformed) == ("The answer is 5.", [], [])


@pytest.mark.parametrize(("body", "error"), [
    ('{"name": "add", "arguments": {"a": 1', r"not valid JSON \(Expecting .* at character \d+\)"),
    ('["add"]', r'needs a JSON object with a "name" string'),
    ('{"arguments": {}}', r'needs a JSON object with a "name" string'),
    ('{"name": "add", "arguments": [1, 2]}', r"arguments\" of tool 'add' must be a JSON object, not list"),
    ('{"name": "add", "arguments": "a=1"}', r"arguments\" of tool 'add' are a string that is not JSON"),
])
def test_a_malformed_call_is_kept_with_a_reason_the_model_can_act_on(body: str, error: str) -> None:
    turn = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert turn.calls == []
    (bad,) = turn.malformed
    assert bad.text == body and bad.call_id == "call_0"
    assert re.search(error, bad.error), bad.error


def test_a_block_left_open_at_the_end_of_the_turn_still_counts() -> None:
    turn = parse_tool_calls('ok <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}')
    assert turn.calls == [ToolCall("add", {"a": 1, "b": 2}, "call_0")] and turn.content == "ok"


async def test_every_call_gets_its_answer_in_order_and_failures_come_back_as_text() -> None:
    async def slow_add(a: int, b: int) -> int:
        await asyncio.sleep(0.2)
        return a + b

    def divide(a: float, b: float) -> float:
        return a / b

    async def stuck() -> str:
        await asyncio.sleep(30)
        return "never"

    tools = FunctionTools({"add": slow_add, "div": divide, "stuck": stuck})
    turn = parse_tool_calls(
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>'
        "<tool_call>not json</tool_call>"
        '<tool_call>{"name": "div", "arguments": {"a": 1, "b": 0}}</tool_call>'
        '<tool_call>{"name": "mul", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
        '<tool_call>{"name": "stuck", "arguments": {}}</tool_call>')
    started = time.monotonic()
    results = await answer_calls(tools, turn, timeout_s=0.5)
    seconds = time.monotonic() - started
    assert [m["tool_call_id"] for m in results.messages] == [f"call_{i}" for i in range(7)]
    contents = [m["content"] for m in results.messages]
    assert contents[:2] == ["3", "7"]
    assert contents[2].startswith("error: the tool call is not valid JSON")
    assert contents[3].startswith("error: ZeroDivisionError: ")  # the wording differs across Python versions
    assert contents[4] == "error: LookupError: unknown tool 'mul'; tools: ['add', 'div', 'stuck']"
    assert contents[5] == "error: TypeError: tool 'add': missing a required argument: 'b'"
    assert contents[6] == "error: tool 'stuck' did not answer within 0.5 s"
    assert results.errors == 5
    assert all(m["role"] == "tool" for m in results.messages)
    assert seconds < 1.0, "the calls did not run concurrently"
