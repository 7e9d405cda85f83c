"""SFT through the same system: the target is the group's label, teacher-forced, never sampled.

A label that is text is one response, ended by EOS. A label that is a list of chat messages is a whole episode
after the prompt (for a warm start of a tool-using policy): the assistant messages' text is what the model learns
to write, each ended by the template's end-of-turn token, and everything between them (tool results, a user's
follow-up, the template's turn markers) is context with loss mask 0, built exactly as the tool loop builds it at
rollout time (`actors.rollout.trajectory`), so the model is taught on the token layout it will generate into.

A record without a label whose prompt is chat messages is slime's SFT layout: the whole conversation is the data,
cut into context and trained tokens by the chat-template family of `--loss-mask-type`
(`actors.data.loss_masks`); the sample's prompt is everything before the first trained token.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from actors.data.loss_masks import multi_turn_tokens
from actors.data.tool_prompts import prompt_stating_tools
from actors.rollout.generate import RolloutContext, failed_sample, make_sample
from actors.rollout.trajectory import ChatTurns, Trajectory, render
from bus.schema import PromptGroup, Sample


async def sft_generate(context: RolloutContext, group: PromptGroup) -> list[Sample]:
    """Samples carry the engine's version so staleness bookkeeping stays uniform; their log-probs are zeros
    because the SFT loss never reads them."""
    if group.label is None and isinstance(group.prompt, list):
        return [_conversation(context, group, index) for index in range(group.n_samples)]
    if group.label is None:
        raise ValueError(f"group {group.group_id}: SFT needs a label (the target response) or a prompt that is a "
                         "whole conversation (chat messages), found neither")
    if isinstance(group.label, list):
        return [_episode(context, group, index) for index in range(group.n_samples)]
    prompt_ids = context.prompt_ids(group.prompt, group.tools, group.images, where=f"group {group.group_id}")
    target = str(group.label)
    response_ids = list(context.tokenizer(target, add_special_tokens=False)["input_ids"])
    if context.tokenizer.eos_token_id is not None:
        response_ids.append(context.tokenizer.eos_token_id)
    version = context.engine.version
    return [
        make_sample(group, index, prompt_ids, response_ids, [0.0] * len(response_ids), [version] * len(response_ids),
                    response=target, status="completed")
        for index in range(group.n_samples)
    ]


def _conversation(context: RolloutContext, group: PromptGroup, index: int) -> Sample:
    mask_type = context.config.sft.loss_mask_type
    ids, mask = multi_turn_tokens(context.tokenizer, group.prompt, mask_type=mask_type, tools=group.tools,
                                  **context.config.data.apply_chat_template_kwargs)
    if 1 not in mask:
        return failed_sample(group, index, ids, f"SFT conversation of {len(group.prompt)} messages has no "
                             f"assistant message to train on (--loss-mask-type {mask_type})")
    start = mask.index(1)
    response = ids[start:]
    version = context.engine.version
    text = context.tokenizer.decode([token for token, trained in zip(ids, mask, strict=True) if trained])
    return make_sample(group, index, ids[:start], response, [0.0] * len(response), [version] * len(response),
                       response=text, status="completed", loss_mask=mask[start:])


def _episode(context: RolloutContext, group: PromptGroup, index: int) -> Sample:
    messages = _target_messages(group)
    tokenizer, kwargs = context.tokenizer, context.config.data.apply_chat_template_kwargs
    prompt = group.prompt if isinstance(group.prompt, list) else [{"role": "user", "content": group.prompt}]
    tools = group.tools  # the record's (--tool-key): the prompt is taught as the rollout will render it
    prompt, _ = prompt_stating_tools(tokenizer, prompt, tools, describe=context.config.agent.agent_describe_tools,
                                     **kwargs)
    turns = ChatTurns.for_tokenizer(tokenizer, tools=tools, **kwargs)
    trajectory = Trajectory(render(tokenizer, prompt, add_generation_prompt=True, tools=tools, **kwargs))
    between: list[dict[str, Any]] = []
    ids: list[int] = []
    version = context.engine.version
    for message in messages:
        if message["role"] != "assistant":
            between.append(message)
            continue
        if trajectory.model_turns:
            trajectory.add_environment(turns.closing(ids) + turns.next_turn(between))
        between = []
        ids = [*tokenizer(message["content"], add_special_tokens=False)["input_ids"], turns.turn_end[0]]
        trajectory.add_model(ids, [0.0] * len(ids), [version] * len(ids))
    text = "\n".join(str(m["content"]) for m in messages)
    return trajectory.to_sample(group, index, response=text, status="completed")


def _target_messages(group: PromptGroup) -> list[Mapping[str, Any]]:
    """The label's messages, checked: every one a role and text, the first and the last the model's."""
    messages = group.label
    where = f"group {group.group_id}: an SFT label that is a list must be chat messages after the prompt"
    if not messages or not all(isinstance(m, Mapping) and isinstance(m.get("role"), str)
                               and isinstance(m.get("content"), str) for m in messages):
        raise ValueError(f"{where}, each with a 'role' and a text 'content'")
    if messages[0]["role"] != "assistant" or messages[-1]["role"] != "assistant":
        raise ValueError(f"{where}, starting and ending with the model's turn ('assistant'); got "
                         f"{messages[0]['role']!r} ... {messages[-1]['role']!r}")
    return messages
