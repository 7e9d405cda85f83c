"""Multi-turn token bookkeeping (#18): over many random conversations and three chat templates, the sequence a
`Trajectory` trains on is the one the engine produced and consumed, and its loss mask covers exactly the model's
tokens.

The templates are written here, in the styles real models ship: ChatML with Hermes-style `<tool_call>` blocks
and consecutive tool results merged into one turn (Qwen2.5-like); the same, dropping the `<think>` part of
assistant turns before the last user message (Qwen3-like: not append-only); and a plain-text one that ends turns
with `</s>`. Newlines after block tags are written as expressions: Hugging Face renders with `trim_blocks`.
Each is loaded into a real Hugging Face tokenizer and rendered by `apply_chat_template`.
"""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import pytest

from actors.rollout.trajectory import ChatTurns, TemplateNotIncremental, Trajectory, render
from bus.schema import PromptGroup
from tools.standins.tiny_model import build_tokenizer

pytestmark = pytest.mark.unit

_LAST_USER = ("{% set ns = namespace(last_user=-1) %}{% for m in messages %}{% if m['role'] == 'user' %}"
              "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}")
_TOOLS = ("{% if tools %}<|im_start|>system\nTools:{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}"
          "<|im_end|>\n{% endif %}")
_TOOL_RESULTS = (
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
)
_CALLS = "{% for c in m.get('tool_calls') or [] %}{{ '\\n' }}<tool_call>\n{{ c | tojson }}\n</tool_call>{% endfor %}"


def _chatml(content: str) -> str:
    return (_LAST_USER + _TOOLS + "{% for m in messages %}{% if m['role'] == 'tool' %}" + _TOOL_RESULTS
            + "{% else %}<|im_start|>{{ m['role'] }}\n" + content + _CALLS + "<|im_end|>\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


CHATML = _chatml("{{ m['content'] }}")
THINK_STRIPPING = _chatml(
    "{% if m['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in m['content'] %}"
    "{{ m['content'].split('</think>')[-1].lstrip('\\n') }}{% else %}{{ m['content'] }}{% endif %}")
PLAIN = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}[BOT] {{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}{{ '\\n' }}<tool_call>{{ c | tojson }}</tool_call>{% endfor %}</s>\n"
    "{% else %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}[BOT] {% endif %}"
)
TOOLS = [{"name": "calc", "description": "arithmetic", "parameters": {"expression": "string"}}]


def model_text(template: str, message: dict[str, Any]) -> str:
    """What the model writes for an assistant message, in the template's own tool-call format."""
    calls = [json.dumps(c, ensure_ascii=False) for c in message.get("tool_calls", [])]
    if template == PLAIN:
        return message["content"] + "".join(f"\n<tool_call>{c}</tool_call>" for c in calls)
    return message["content"] + "".join(f"\n<tool_call>\n{c}\n</tool_call>" for c in calls)


def random_conversation(rng: random.Random) -> list[dict[str, Any]]:
    words = ["2+3", "ok", "the sum", "is 5", "let me check", "done", "why?", "x = 7", "hmm"]
    conversation: list[dict[str, Any]] = []
    if rng.random() < 0.5:
        conversation.append({"role": "system", "content": "be brief"})
    conversation.append({"role": "user", "content": rng.choice(words)})
    for turn in range(rng.randint(1, 4)):
        content = " ".join(rng.choices(words, k=rng.randint(0, 3)))
        if rng.random() < 0.5:
            content = f"<think>\n{rng.choice(words)}\n</think>\n{content}"
        calls = [{"name": "calc", "arguments": {"expression": rng.choice(words)}}
                 for _ in range(rng.choice([0, 0, 1, 2, 3]))]
        conversation.append({"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})})
        last = turn == 3 or rng.random() < 0.3
        if calls:
            conversation += [{"role": "tool", "content": str(rng.randint(0, 99))} for _ in calls]
        elif last:
            break
        else:
            conversation.append({"role": "user", "content": rng.choice(words)})
    if conversation[-1]["role"] != "assistant":
        conversation.append({"role": "assistant", "content": "done"})
    return conversation


def roll_out(template: str, conversation: list[dict[str, Any]], rng: random.Random
             ) -> tuple[Trajectory, list[list[int]]]:
    """Plays the conversation as a multi-turn generate function would: the model's turns are "generated" token
    ids (sometimes stopped on the `</tool_call>` stop string instead of the end-of-turn token), the rest comes
    from ChatTurns. Returns the trajectory and each model turn's ids as generated."""
    tokenizer = build_tokenizer()
    tokenizer.chat_template = template
    turns = ChatTurns.for_tokenizer(tokenizer, tools=TOOLS)
    first_model = next(i for i, m in enumerate(conversation) if m["role"] == "assistant")
    trajectory = Trajectory(render(tokenizer, conversation[:first_model], add_generation_prompt=True, tools=TOOLS))
    generated: list[list[int]] = []
    pending: list[dict[str, Any]] = []
    for version, message in enumerate(conversation[first_model:]):
        if message["role"] != "assistant":
            pending.append(message)
            continue
        if pending:
            trajectory.add_environment(turns.next_turn(pending))
            pending = []
        ids = list(tokenizer(model_text(template, message), add_special_tokens=False)["input_ids"])
        if not (message.get("tool_calls") and rng.random() < 0.5):  # else stopped on "</tool_call>"
            ids.append(turns.turn_end[0])
        trajectory.add_model(ids, [-0.5] * len(ids), [version] * len(ids))
        trajectory.add_environment(turns.closing(ids))
        generated.append(ids)
    return trajectory, generated


def masked_runs(trajectory: Trajectory) -> list[list[int]]:
    runs: list[list[int]] = []
    previous = 0
    for token, mask in zip(trajectory.response_ids, trajectory.loss_mask, strict=True):
        if mask and not previous:
            runs.append([])
        if mask:
            runs[-1].append(token)
        previous = mask
    return runs


@pytest.mark.parametrize("template", [CHATML, THINK_STRIPPING, PLAIN], ids=["chatml", "think-stripping", "plain"])
def test_trained_tokens_are_the_generated_ones_and_the_mask_covers_exactly_them(template: str) -> None:
    rng = random.Random(0)
    for _ in range(150):
        conversation = random_conversation(rng)
        trajectory, generated = roll_out(template, conversation, rng)
        assert masked_runs(trajectory) == generated
        assert sum(trajectory.loss_mask) == sum(len(ids) for ids in generated)
        assert trajectory.model_turns == len(generated)


@pytest.mark.parametrize("template", [CHATML, PLAIN], ids=["chatml", "plain"])
def test_on_an_append_only_template_the_trajectory_is_the_rendered_conversation(template: str) -> None:
    """Nothing dropped between turns: separators, merged tool results and the turn ends the model did not write
    are all there, token for token."""
    rng = random.Random(1)
    tokenizer = build_tokenizer()
    tokenizer.chat_template = template
    for _ in range(150):
        conversation = random_conversation(rng)
        trajectory, _ = roll_out(template, conversation, rng)
        rendered = render(tokenizer, conversation, add_generation_prompt=False, tools=TOOLS)
        assert trajectory.prompt_ids + trajectory.response_ids == rendered


def test_a_template_that_drops_earlier_thinking_keeps_the_generated_thinking() -> None:
    """Re-rendering with the Qwen3-like template loses the `<think>` of earlier turns: that is the corruption the
    trajectory avoids. What it trains on is the conversation as generated (the ChatML rendering, which keeps it)."""
    rng = random.Random(2)
    tokenizer = build_tokenizer()
    differs = 0
    for _ in range(150):
        conversation = random_conversation(rng)
        trajectory, _ = roll_out(THINK_STRIPPING, conversation, rng)
        tokenizer.chat_template = CHATML
        as_generated = render(tokenizer, conversation, add_generation_prompt=False, tools=TOOLS)
        tokenizer.chat_template = THINK_STRIPPING
        re_rendered = render(tokenizer, conversation, add_generation_prompt=False, tools=TOOLS)
        assert trajectory.prompt_ids + trajectory.response_ids == as_generated
        differs += re_rendered != as_generated
    assert differs > 10, "the sampled conversations never exercised the template's stripping"


def test_a_template_that_is_not_incremental_is_refused_by_name() -> None:
    tokenizer = build_tokenizer()
    # The last assistant message rendered its own way: an anchor turn changes once a message follows it.
    tokenizer.chat_template = _chatml("{{ m['content'] }}{% if loop.last and m['role'] == 'assistant' %} (final)"
                                      "{% endif %}")
    turns = ChatTurns.for_tokenizer(tokenizer)
    with pytest.raises(TemplateNotIncremental, match=r"renders the turns before \['tool'\] differently"):
        turns.next_turn([{"role": "tool", "content": "5"}])
    tokenizer.chat_template = CHATML.replace("{{ m['content'] }}", "{{ m['content'] | upper }}")
    with pytest.raises(TemplateNotIncremental, match=r"generation prompt followed by the message's text"):
        ChatTurns.for_tokenizer(tokenizer)


def test_environment_tokens_carry_the_version_before_them_and_the_sample_counts_turns() -> None:
    trajectory = Trajectory([1, 2])
    trajectory.add_model([10, 11], [-0.1, -0.2], [3, 4])
    trajectory.add_environment([20, 21, 22])
    trajectory.add_model([12], [-0.3], [5])
    with pytest.raises(ValueError, match=r"one log-prob and one weight version per token; got 2 tokens, 1"):
        trajectory.add_model([1, 2], [0.0], [1, 1])
    group = PromptGroup(group_id="g", prompt="p", label="l", n_samples=1, data_index=0)
    sample = trajectory.to_sample(group, 0, response="r", status="completed")
    assert sample.tokens.tolist() == [1, 2, 10, 11, 20, 21, 22, 12]
    assert sample.loss_mask.tolist() == [1, 1, 0, 0, 0, 1]
    assert sample.token_versions.tolist() == [3, 4, 4, 4, 4, 5]
    assert np.allclose(sample.rollout_log_probs, [-0.1, -0.2, 0, 0, 0, -0.3])
    assert sample.metadata["turns"] == 2 and sample.metadata["environment_tokens"] == 3
