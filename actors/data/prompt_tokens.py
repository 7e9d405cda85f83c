"""A prompt's token ids, computed one way for the rollout workers and for the loaders that filter long prompts.

The buffer and the eval rounds drop prompts over `--rollout-max-prompt-len` / `--eval-max-prompt-len` when a
dataset loads; that count must be the very token count the engine will see, so both sides call `encode_prompt`
with the same chat-template switch and keyword arguments (`--apply-chat-template-kwargs`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from actors.config import RunConfig
from actors.data.tool_prompts import prompt_stating_tools

Prompt = str | list[dict[str, Any]]


def encode_prompt(tokenizer: Any, prompt: Prompt, *, chat_template: bool,
                  chat_template_kwargs: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None,
                  describe_ignored_tools: bool = True) -> list[int]:
    """Token ids of one prompt: chat messages (or a string with `chat_template`) go through the chat template, with
    the record's `tools` (`--tool-key`); a template that leaves tools out gets them stated in the system message
    unless `describe_ignored_tools` is off (`--no-agent-describe-tools`)."""
    if chat_template or isinstance(prompt, list):
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        kwargs = dict(chat_template_kwargs or {})
        messages, _ = prompt_stating_tools(tokenizer, messages, tools, describe=describe_ignored_tools, **kwargs)
        if tools:
            kwargs["tools"] = tools
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    if tools:
        raise ValueError("a prompt with tools (--tool-key) reaches the model through the chat template: give chat "
                         "messages or --apply-chat-template")
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])


def prompt_length_counter(config: RunConfig, tokenizer: Any | None = None
                          ) -> Callable[[Prompt, list[dict[str, Any]] | None], int]:
    """`(prompt, tools) -> token count` as the rollout workers will tokenize it; loads --hf-checkpoint's tokenizer
    unless one is given (a prompt-length cap cannot be honoured without the model's tokenizer)."""
    if tokenizer is None:
        if config.model.hf_checkpoint is None:
            raise ValueError("--rollout-max-prompt-len / --eval-max-prompt-len count tokens and need "
                             "--hf-checkpoint (the tokenizer)")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.model.hf_checkpoint)
    data = config.data

    def count(prompt: Prompt, tools: list[dict[str, Any]] | None = None) -> int:
        return len(encode_prompt(tokenizer, prompt, chat_template=data.apply_chat_template,
                                 chat_template_kwargs=data.apply_chat_template_kwargs, tools=tools,
                                 describe_ignored_tools=config.agent.agent_describe_tools))

    return count
