"""A task a model solves reliably only with a tool: add two 2-digit numbers, with an `add` tool at hand.

The tiny model cannot add by itself (a few million parameters, character tokens); it can copy digits. SmolLM2-135M
adds two-digit numbers right about half the time. So an episode succeeds reliably when the model calls the tool with
the prompt's operands, in Hermes form, and then answers with the tool's result. `tools/agent_demo.py` warm-starts a
model by SFT on a mix of such episodes and of direct answers (right ones, which it cannot reproduce on every new
pair), then trains it with GRPO through the built-in tool loop or through the example client agents
(`examples/openai_agent.py`, `responses_agent.py`, `anthropic_agent.py`); held-out accuracy and the tool-call rate
show what RL changed.

Flags: `--agent-tools-path examples.tool_arithmetic:FUNCTIONS --custom-rm-path
examples.tool_arithmetic:final_answer_reward` (and `--rollout-stop-token-ids` with the model's end-of-turn token
where its generation config does not end a turn there).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actors.plugins import RewardInput


def add(a: int, b: int) -> int:
    return int(a) + int(b)


FUNCTIONS = {"add": add}


def tool_call(a: int, b: int) -> str:
    """How the tiny model writes a call to `add` (compact JSON: fewer characters to learn)."""
    arguments = json.dumps({"a": a, "b": b}, separators=(",", ":"))
    return f'<tool_call>{{"name":"add","arguments":{arguments}}}</tool_call>'


def described_tool_call(a: int, b: int) -> str:
    """A call to `add` as the agent endpoint's description of the tools shows one (`describe_tools`), for a model
    that reads that description."""
    return "<tool_call>\n" + json.dumps({"name": "add", "arguments": {"a": a, "b": b}}) + "\n</tool_call>"


@dataclass(frozen=True)
class Phrasing:
    """How a model is asked for a sum and how it calls the tool. `system` is the system message of its SFT prompts:
    the text its rollout prompts will carry there (a description of the tools, where the agent endpoint states them
    for a template that leaves tools out), so the warm start sees the prompt the episodes will."""

    question: str = "{a}+{b}"
    call: Callable[[int, int], str] = tool_call
    system: str | None = None


def final_answer_reward(inp: RewardInput) -> float:
    """1 when the episode's last turn says exactly the sum: an answer copied from a tool result counts, the tool
    result alone does not."""
    answer = str(inp.metadata.get("final_answer", "")).strip()
    return 1.0 if answer == str(inp.label).strip() else 0.0


def episode(a: int, b: int, *, with_tool: bool, call: Callable[[int, int], str] = tool_call,
            review: str | None = None) -> list[dict[str, Any]]:
    """An SFT label: the model's turns (and the tool's) after the question; with `review`, the user's question
    after the answer and the answer again, as the example client agents end every episode."""
    total = str(a + b)
    turns = [{"role": "assistant", "content": call(a, b)}, {"role": "tool", "content": total}] if with_tool else []
    turns.append({"role": "assistant", "content": total})
    if review is not None:
        turns += [{"role": "user", "content": review}, {"role": "assistant", "content": total}]
    return turns


def make_tool_task_data(out_dir: Path, *, low: int = 10, high: int = 99, eval_size: int = 100, sft_size: int = 400,
                        tool_share: float = 0.5, phrasing: Phrasing = Phrasing(), review: str | None = None,
                        seed: int = 0) -> dict[str, Path]:
    """train.jsonl (RL prompts), eval.jsonl (held-out pairs, never in train or sft) and sft.jsonl (episodes, a
    `tool_share` of them using the tool, each ending with `review` and the answer again when one is given).

    The pairs, and which SFT episodes use the tool, depend on `seed` and `tool_share` only: every phrasing and
    conversation shape is trained and evaluated on the same ones."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(low, high + 1) for b in range(low, high + 1)]
    rng.shuffle(pairs)
    held_out, rest = pairs[:eval_size], pairs[eval_size:]
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {name: out_dir / f"{name}.jsonl" for name in ("train", "eval", "sft")}
    ask = phrasing.question.format
    _write(paths["train"], [{"input": ask(a=a, b=b), "label": str(a + b)} for a, b in rest])
    _write(paths["eval"], [{"input": ask(a=a, b=b), "label": str(a + b)} for a, b in held_out])
    system = [] if phrasing.system is None else [{"role": "system", "content": phrasing.system}]
    _write(paths["sft"], [
        {"input": [*system, {"role": "user", "content": ask(a=a, b=b)}] if system else ask(a=a, b=b),
         "label": episode(a, b, with_tool=rng.random() < tool_share, call=phrasing.call, review=review)}
        for a, b in rest[:sft_size]])
    return paths


def _write(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
