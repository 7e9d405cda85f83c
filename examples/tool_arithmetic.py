"""A task a tiny model can only solve with a tool: add two 2-digit numbers, with an `add` tool at hand.

The model cannot add by itself (a few million parameters, character tokens); it can copy digits. So an episode
succeeds when the model calls the tool with the prompt's operands, in Hermes form, and then answers with the tool's
result. `tools/agent_demo.py` warm-starts it by SFT on a mix of such episodes and of direct answers (right ones,
which it cannot reproduce on new pairs), then trains it with GRPO through the built-in tool loop; held-out
accuracy and the tool-call rate show what RL changed.

Flags: `--agent-tools-path examples.tool_arithmetic:FUNCTIONS --custom-rm-path
examples.tool_arithmetic:final_answer_reward`, and `--rollout-stop-token-ids` with the model's end-of-turn token.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from actors.plugins import RewardInput


def add(a: int, b: int) -> int:
    return int(a) + int(b)


FUNCTIONS = {"add": add}


def tool_call(a: int, b: int) -> str:
    """How the model writes a call to `add` (compact JSON: fewer characters to learn)."""
    arguments = json.dumps({"a": a, "b": b}, separators=(",", ":"))
    return f'<tool_call>{{"name":"add","arguments":{arguments}}}</tool_call>'


def final_answer_reward(inp: RewardInput) -> float:
    """1 when the episode's last turn says exactly the sum: an answer copied from a tool result counts, the tool
    result alone does not."""
    answer = str(inp.metadata.get("final_answer", "")).strip()
    return 1.0 if answer == str(inp.label).strip() else 0.0


def episode(a: int, b: int, *, with_tool: bool) -> list[dict[str, Any]]:
    """An SFT label: the model's turns (and the tool's) after the prompt `a+b`."""
    total = str(a + b)
    if not with_tool:
        return [{"role": "assistant", "content": total}]
    return [{"role": "assistant", "content": tool_call(a, b)}, {"role": "tool", "content": total},
            {"role": "assistant", "content": total}]


def make_tool_task_data(out_dir: Path, *, low: int = 10, high: int = 99, eval_size: int = 100, sft_size: int = 400,
                        tool_share: float = 0.5, seed: int = 0) -> dict[str, Path]:
    """train.jsonl (RL prompts), eval.jsonl (held-out pairs, never in train or sft) and sft.jsonl (episodes, a
    `tool_share` of them using the tool)."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(low, high + 1) for b in range(low, high + 1)]
    rng.shuffle(pairs)
    held_out, rest = pairs[:eval_size], pairs[eval_size:]
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {name: out_dir / f"{name}.jsonl" for name in ("train", "eval", "sft")}
    _write(paths["train"], [{"input": f"{a}+{b}", "label": str(a + b)} for a, b in rest])
    _write(paths["eval"], [{"input": f"{a}+{b}", "label": str(a + b)} for a, b in held_out])
    _write(paths["sft"], [{"input": f"{a}+{b}", "label": episode(a, b, with_tool=rng.random() < tool_share)}
                          for a, b in rest[:sft_size]])
    return paths


def _write(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
