"""Tools in a prompt: a dataset row's tool definitions (`--tool-key`) and an agent's request's `tools` reach the
model through the chat template, or, where the template leaves them out (SmolLM2's renders the same with and without
them), stated in the system message in the format the rollout's tool-call parser reads back
(`actors/rollout/tool_calls.py`). Both the rollout workers and the loaders that count prompt tokens render a prompt
this way, so a prompt-length cap counts what the engine will see."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

PROBE = [{"role": "user", "content": "probe"}]  # plain text every template renders the same with or without tools


def describe_tools(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tools stated for a system message: each schema as one JSON line inside `<tools>`, and how a call is
    written (`<tool_call>` blocks, the Hermes convention the parser reads)."""
    schemas = "\n".join(json.dumps(dict(tool), ensure_ascii=False) for tool in tools)
    return ("# Tools\n\nYou can call the functions below. Each is one JSON schema per line inside <tools></tools>:\n"
            f"<tools>\n{schemas}\n</tools>\n\n"
            "To call one, write a JSON object with its name and its arguments inside <tool_call></tool_call>, one "
            "block per call:\n<tool_call>\n{\"name\": <function name>, \"arguments\": <the arguments as a JSON "
            "object>}\n</tool_call>")


def with_tools_described(messages: Sequence[Mapping[str, Any]],
                         tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with the tools stated in the system message: after its own system text, or as a system message of
    their own. Only the prompt's tokens change; the conversation a client sends back stays its own."""
    described = describe_tools(tools)
    messages = [dict(message) for message in messages]
    if messages and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
        messages[0]["content"] = f"{messages[0]['content']}\n\n{described}"
        return messages
    return [{"role": "system", "content": described}, *messages]


def template_renders_tools(tokenizer: Any, tools: Sequence[Mapping[str, Any]], **template_kwargs: Any) -> bool:
    """Whether the chat template puts `tools` in the prompt at all: a model given tools by a template that drops
    them never learns they exist. Asked once per tokenizer, tool set and template arguments: every prompt of a
    dataset's tool records would otherwise render the probe twice more."""
    return _renders_tools(tokenizer, json.dumps([dict(tool) for tool in tools], sort_keys=True, default=str),
                          json.dumps(template_kwargs, sort_keys=True, default=str))


@functools.lru_cache(maxsize=256)
def _renders_tools(tokenizer: Any, tools_json: str, kwargs_json: str) -> bool:
    template_kwargs = json.loads(kwargs_json)

    def rendered(**extra: Any) -> Any:
        ids = tokenizer.apply_chat_template(PROBE, add_generation_prompt=True, tokenize=True,
                                            **template_kwargs, **extra)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    return rendered(tools=json.loads(tools_json)) != rendered()


def prompt_stating_tools(tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]
                         | None, *, describe: bool, **template_kwargs: Any) -> tuple[list[dict[str, Any]], bool]:
    """The prompt's messages as the model must see them with `tools`: as they are where the template renders the
    tools (or there are none, or `describe` is off: `--no-agent-describe-tools`), else with the tools stated in
    the system message; and whether they were stated. Every path that renders a prompt with tools asks this."""
    if tools and describe and not template_renders_tools(tokenizer, tools, **template_kwargs):
        return with_tools_described(messages, tools), True
    return [dict(message) for message in messages], False
