"""slime's multi-turn SFT loss masks (`--loss-mask-type`, actors/data/loss_masks.py) on real tokenizers: the
tiny models' ChatML template (no default system prompt) and SmolLM2's (ChatML with one), and the SFT generate
path that turns a conversation into a sample."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from actors.config import build_config
from actors.data.loss_masks import multi_turn_tokens
from actors.rollout.generate import RolloutContext
from bus.schema import PromptGroup

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3="},
        {"role": "assistant", "content": "5"}, {"role": "user", "content": "times?"},
        {"role": "assistant", "content": "6"}]
NO_SYSTEM = CHAT[1:]


def _tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _whole(tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _trained_spans(tokenizer, ids: list[int], mask: list[int]) -> list[str]:
    spans, current = [], []
    for token, trained in zip(ids, mask, strict=True):
        if trained:
            current.append(token)
        elif current:
            spans, current = [*spans, tokenizer.decode(current)], []
    return spans + ([tokenizer.decode(current)] if current else [])


@pytest.fixture(scope="module")
def tiny_qwen3(tiny_model_cache: Path) -> Path:
    from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model

    return cached_tiny_model(tiny_model_cache, TinyModelSpec(family="qwen3"))


@pytest.mark.unit
@pytest.mark.parametrize("mask_type", ["qwen", "qwen3"])
@pytest.mark.parametrize("messages", [CHAT, NO_SYSTEM], ids=["system", "no-system"])
def test_chatml_masks_train_each_assistant_turn_after_its_header(tiny_qwen3: Path, mask_type: str,
                                                                 messages: list[dict]) -> None:
    tokenizer = _tokenizer(tiny_qwen3)
    ids, mask = multi_turn_tokens(tokenizer, messages, mask_type=mask_type)
    assert ids == _whole(tokenizer, messages)
    assert _trained_spans(tokenizer, ids, mask) == ["5<|im_end|>\n", "6<|im_end|>\n"]


@pytest.mark.integration
@pytest.mark.parametrize("mask_type", ["qwen", "qwen3"])
def test_a_default_system_prompt_is_kept_once_and_never_trained(smollm2_path: Path, mask_type: str) -> None:
    """SmolLM2's template adds its system prompt to a conversation without one: the cut keeps it at the start only
    (slime's qwen3 cut would lose it: it assumes Qwen3's template, which adds none)."""
    tokenizer = _tokenizer(smollm2_path)
    ids, mask = multi_turn_tokens(tokenizer, NO_SYSTEM, mask_type=mask_type)
    assert ids == _whole(tokenizer, NO_SYSTEM)
    assert "You are a helpful AI assistant" in tokenizer.decode(ids[:20])
    assert _trained_spans(tokenizer, ids, mask) == ["5<|im_end|>\n", "6<|im_end|>\n"]


@pytest.mark.unit
def test_qwen3_joins_consecutive_tool_results_and_step_loss_mask_leaves_a_turn_untrained(tiny_qwen3: Path) -> None:
    tokenizer = _tokenizer(tiny_qwen3)
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "call", "step_loss_mask": 0},
                {"role": "tool", "content": "a"}, {"role": "tool", "content": "b"},
                {"role": "assistant", "content": "done"}]
    ids, mask = multi_turn_tokens(tokenizer, messages, mask_type="qwen3")
    assert ids == _whole(tokenizer, messages)
    assert _trained_spans(tokenizer, ids, mask) == ["done<|im_end|>\n"]


@pytest.mark.unit
def test_distill_qwen_trains_the_last_message_after_the_first_one_as_prompt(tiny_qwen3: Path) -> None:
    tokenizer = _tokenizer(tiny_qwen3)
    ids, mask = multi_turn_tokens(tokenizer, NO_SYSTEM, mask_type="distill_qwen")
    assert tokenizer.decode(ids) == "<|im_start|>user\n2+3=<|im_end|>\n<|im_start|>assistant\n6"
    assert _trained_spans(tokenizer, ids, mask) == ["6"]


# Qwen3.5's way of rendering a conversation, cut down: an assistant turn after the last user message shows its
# reasoning in a <think> block, an earlier one only its answer; so a message renders differently alone than in place.
QWEN3_5_LIKE = (
    "{% set ns = namespace(last_user=0) %}{% for m in messages %}{% if m.role == 'user' %}"
    "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if loop.index0 > ns.last_user and m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n"
    "{% endif %}{{ m.content }}<|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
REASONED = [*CHAT[:4], {"role": "assistant", "content": "the answer", "reasoning_content": "think it over"},
            {"role": "assistant", "content": "6", "reasoning_content": "2*3"}]


@pytest.mark.unit
def test_qwen3_5_cuts_the_rendered_conversation_by_characters_and_leaves_the_think_opening_untrained(
        tiny_qwen3: Path) -> None:
    """Each assistant turn as it stands in the whole rendering (the earlier one without its reasoning, the two
    after the last user message with theirs) is trained from after its header, and after `<think>\n`, through its
    `<|im_end|>` and newline; a turn with step_loss_mask 0 is context."""
    tokenizer = _tokenizer(tiny_qwen3)
    tokenizer.chat_template = QWEN3_5_LIKE
    ids, mask = multi_turn_tokens(tokenizer, REASONED, mask_type="qwen3_5")
    assert ids == _whole(tokenizer, REASONED)
    assert "<think>\nthink it over\n</think>" in tokenizer.decode(ids) and "think" not in tokenizer.decode(ids[:30])
    assert _trained_spans(tokenizer, ids, mask) == [
        "5<|im_end|>\n", "think it over\n</think>\n\nthe answer<|im_end|>\n",
        "2*3\n</think>\n\n6<|im_end|>\n"]
    quiet = [{**m, "step_loss_mask": 0} if m.get("content") == "the answer" else m for m in REASONED]
    _, quiet_mask = multi_turn_tokens(tokenizer, quiet, mask_type="qwen3_5")
    assert _trained_spans(tokenizer, ids, quiet_mask) == ["5<|im_end|>\n", "2*3\n</think>\n\n6<|im_end|>\n"]
    tokenizer.chat_template = "{% for m in messages %}### {{ m.role }}: {{ m.content }}\n{% endfor %}"
    with pytest.raises(ValueError, match=r"message 2 \(assistant\) has no .* turn in the rendered conversation"):
        multi_turn_tokens(tokenizer, CHAT, mask_type="qwen3_5")


@pytest.mark.unit
def test_loss_mask_types_not_built_are_refused_by_name() -> None:
    from actors.config.settings_errors import SettingsError

    with pytest.raises(SettingsError, match="loss_mask_type 'glm': unknown; choose one of qwen, qwen3, qwen3_5"):
        build_config({"loss_mask_type": "glm"})


@pytest.mark.integration
def test_sft_on_a_conversation_trains_its_assistant_tokens_and_fails_one_without_any(tiny_qwen3: Path) -> None:
    from actors.rollout.sft import sft_generate
    from engines.inference.torch_engine import TorchEngine

    tokenizer = _tokenizer(tiny_qwen3)
    config = build_config({"hf_checkpoint": str(tiny_qwen3), "loss_type": "sft", "label_key": "none"})
    taught = PromptGroup(group_id="g", prompt=NO_SYSTEM, label=None, n_samples=1)
    untaught = PromptGroup(group_id="h", prompt=NO_SYSTEM[:1], label=None, n_samples=1)

    async def generate():
        engine = TorchEngine.from_pretrained(tiny_qwen3, max_batch_size=1)
        try:
            context = RolloutContext(engine=engine, tokenizer=tokenizer, config=config, worker_id="w")
            return await sft_generate(context, taught), await sft_generate(context, untaught)
        finally:
            await engine.close()

    (sample,), (failed,) = asyncio.run(generate())
    prompt = tokenizer.decode(sample.tokens[:sample.prompt_tokens].tolist())
    assert prompt == "<|im_start|>user\n2+3=<|im_end|>\n<|im_start|>assistant\n"
    assert sample.status == "completed" and sample.loss_mask.sum() == len("5") + 2 + len("6") + 2
    assert failed.status == "failed" and "no assistant message to train on" in failed.error
