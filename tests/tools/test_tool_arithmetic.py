"""The multi-turn tool task of tools/agent_demo.py: held-out pairs stay held out, the SFT episodes are episodes
the tool loop would produce, and only a final answer that says the sum earns reward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.rollout.tool_calls import parse_tool_calls
from examples.tool_arithmetic import FUNCTIONS, final_answer_reward, make_tool_task_data
from policies.rewards import RewardInput

pytestmark = pytest.mark.unit


def test_held_out_pairs_are_never_trained_on_and_sft_mixes_tool_and_direct_episodes(tmp_path: Path) -> None:
    paths = make_tool_task_data(tmp_path, eval_size=50, sft_size=200, tool_share=0.5, seed=3)
    rows = {name: [json.loads(line) for line in path.read_text().splitlines()] for name, path in paths.items()}
    held_out = {row["input"] for row in rows["eval"]}
    assert len(held_out) == 50
    assert not held_out & {row["input"] for row in rows["train"]}
    assert not held_out & {row["input"] for row in rows["sft"]}
    with_tool = 0
    for row in rows["sft"]:
        a, b = map(int, row["input"].split("+"))
        turns = row["label"]
        assert turns[-1] == {"role": "assistant", "content": str(a + b)}
        if len(turns) == 3:
            (call,) = parse_tool_calls(turns[0]["content"]).calls
            assert FUNCTIONS[call.name](**call.arguments) == a + b
            assert turns[1] == {"role": "tool", "content": str(a + b)}
            with_tool += 1
    assert 70 < with_tool < 130


def test_only_a_final_answer_with_the_sum_is_rewarded() -> None:
    def reward(final: str | None) -> float:
        metadata = {} if final is None else {"final_answer": final}
        return final_answer_reward(RewardInput(prompt="12+30", response="...42...", label="42", metadata=metadata))

    assert reward("42") == 1.0 and reward(" 42\n") == 1.0
    assert reward("41") == 0.0 and reward("") == 0.0 and reward(None) == 0.0
