"""The tiny models' character-level tokenizer: every printable character, newlines included, is one token."""

from __future__ import annotations

import pytest

from engines.tiny_model import build_tokenizer

pytestmark = pytest.mark.unit


def test_every_character_is_one_token_and_decodes_back_runs_of_newlines_too() -> None:
    tokenizer = build_tokenizer()
    text = "Q: 2+3?\n\nA: 5\n\n\n<|im_end|>"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.unk_token_id not in ids
    assert len(ids) == len(text) - len("<|im_end|>") + 1  # the special token is one id
    assert tokenizer.decode(ids) == text
