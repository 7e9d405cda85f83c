"""The tiny models' character-level tokenizer: every printable character, newlines included, is one token."""

from __future__ import annotations

import pytest

from tools.standins.tiny_model import build_tokenizer

pytestmark = pytest.mark.unit


def test_every_character_is_one_token_and_decodes_back_runs_of_newlines_too() -> None:
    tokenizer = build_tokenizer()
    text = "Q: 2+3?\n\nA: 5\n\n\n<|im_end|>"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.unk_token_id not in ids
    assert len(ids) == len(text) - len("<|im_end|>") + 1  # the special token is one id
    assert tokenizer.decode(ids) == text


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama", "qwen3_moe", "mixtral"])
def test_a_saved_tiny_model_loads_a_tokenizer_that_keeps_spaces_and_newlines(family: str, tmp_path) -> None:
    """transformers 5 loads a qwen2 folder with `Qwen2Tokenizer`, which brings its own byte-level pre-tokenizer and
    decoder: with a plain-character vocabulary, "a b\\nc" came back as "abc"."""
    from transformers import AutoTokenizer

    from tools.standins.tiny_model import TinyModelSpec, create_tiny_model

    loaded = AutoTokenizer.from_pretrained(create_tiny_model(tmp_path, TinyModelSpec(family=family)))
    text = "Q: 2 + 3?\n\nA: 5 ~`\n<|im_end|>"
    ids = loaded(text, add_special_tokens=False)["input_ids"]
    assert ids == build_tokenizer()(text, add_special_tokens=False)["input_ids"]
    assert loaded.decode(ids) == text

