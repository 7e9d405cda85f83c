"""A prompt's token ids, computed one way for the rollout workers and for the loaders that filter long prompts.

The buffer and the eval rounds drop prompts over `--rollout-max-prompt-len` / `--eval-max-prompt-len` when a
dataset loads; that count must be the very token count the engine will see, so both sides call `encode_prompt`
with the same chat-template switch and keyword arguments (`--apply-chat-template-kwargs`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from actors.config import RunConfig

Prompt = str | list[dict[str, Any]]


def encode_prompt(tokenizer: Any, prompt: Prompt, *, chat_template: bool,
                  chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of one prompt: chat messages (or a string with `chat_template`) go through the chat template."""
    if chat_template or isinstance(prompt, list):
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            **(chat_template_kwargs or {}))
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])


def prompt_length_counter(config: RunConfig, tokenizer: Any | None = None) -> Callable[[Prompt], int]:
    """`prompt -> token count` as the rollout workers will tokenize it; loads --hf-checkpoint's tokenizer unless
    one is given (a prompt-length cap cannot be honoured without the model's tokenizer)."""
    if tokenizer is None:
        if config.model.hf_checkpoint is None:
            raise ValueError("--rollout-max-prompt-len / --eval-max-prompt-len count tokens and need "
                             "--hf-checkpoint (the tokenizer)")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.model.hf_checkpoint)
    data = config.data

    def count(prompt: Prompt) -> int:
        return len(encode_prompt(tokenizer, prompt, chat_template=data.apply_chat_template,
                                 chat_template_kwargs=data.apply_chat_template_kwargs))

    return count
