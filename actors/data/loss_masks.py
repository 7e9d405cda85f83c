"""slime's multi-turn SFT loss masks (`--loss-mask-type`): a whole conversation tokenised message by message
through the chat template, the assistant messages' tokens trained on (mask 1) and everything else context (0).

Each type is how one template family is cut into messages, as slime cuts it:

- `qwen` (ChatML: Qwen2/2.5, and any template that renders each message as a turn of its own): every message is
  rendered alone; the system prompt a template adds when the conversation has none (Qwen2.5's "You are Qwen...")
  is kept once, at the start, and taken off every later message. An assistant message's turn header
  (`<|im_start|>assistant\\n`, the template's generation prompt) is context; its text, end-of-turn token and the
  newline after it are trained on. A tokenizer of DeepSeek's R1 distills (`<｜Assistant｜>` in its vocabulary) is
  read as `distill_qwen`, as slime reads it.
- `qwen3`: every message is rendered after a stand-in user turn (so a template that renders an assistant turn by
  its place in the conversation, as Qwen3's does with `<think>`, renders it as a later turn), and consecutive tool
  results as one turn, as Qwen templates join them. A default system prompt is kept once, at the start (slime's
  cut assumes a template without one, as Qwen3's is).
- `distill_qwen`: the first message as the prompt with the generation prompt, the last message's text as the whole
  response (no end-of-turn token: the R1 distills' template ends a turn with EOS the model writes itself).
- `qwen3_5`: the whole conversation rendered once and cut by characters, not messages: Qwen3.5's template renders an
  assistant turn by where it stands (its reasoning kept only after the last user message), so no message renders
  alone as it does in the conversation. In the rendered text each assistant turn runs from its header
  (`<|im_start|>assistant\n`) to its `<|im_end|>` and the newline after it; the characters after the header (and
  after an opening `<think>\n`, which the template writes, not the model) through that newline are trained, and a
  token is trained when any of its characters is. It needs a fast tokenizer (character offsets) whose tokens of
  the rendered text are the template's own.

Shared by the rollout worker's SFT path (`actors/rollout/sft.py`) and the client of slime's rollout-buffer service
(`actors/slime_compat/rollout_buffer.py`), which turns the service's conversations into samples as slime does.

A message with `step_loss_mask` other than 1 is context even when it is the model's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from actors.config.sft import check_loss_mask_type

Tokenizer = Any  # a Hugging Face tokenizer with a chat template (the rollout path's `Tokenizer` protocol, and more)

Message = Mapping[str, Any]
Tools = Sequence[Mapping[str, Any]] | None
DISTILL_MARK = "<｜Assistant｜>"  # in the added vocabulary of DeepSeek-R1's Qwen distills
_PROBE = "probe"  # a user message's text; only the length of its rendering matters
_STAND_IN = {"role": "user", "content": "context before the message"}
ASSISTANT_HEADER, TURN_END, THINK_OPEN = "<|im_start|>assistant\n", "<|im_end|>", "<think>\n"  # qwen3_5's marks


def render(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool,
           tools: Sequence[Mapping[str, Any]] | None = None, **template_kwargs: Any) -> list[int]:
    """Token ids of `messages` through the tokenizer's chat template (a list, or a mapping with "input_ids")."""
    if tools is not None:
        template_kwargs["tools"] = list(tools)
    ids = tokenizer.apply_chat_template([dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                                        tokenize=True, **template_kwargs)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def multi_turn_tokens(tokenizer: Tokenizer, messages: Sequence[Message], *, mask_type: str, tools: Tools = None,
                      **template_kwargs: Any) -> tuple[list[int], list[int]]:
    """(token ids of the whole conversation, loss mask of the same length) as `mask_type` cuts it."""
    if mask_type == "qwen" and DISTILL_MARK in tokenizer.get_added_vocab():
        mask_type = "distill_qwen"
    cut: Callable[..., tuple[list[int], list[int]]] = {
        "qwen": _each_alone, "qwen3": _each_after_a_turn, "distill_qwen": _first_and_last,
        "qwen3_5": _by_characters}[check_loss_mask_type(
            mask_type)]
    ids, mask = cut(tokenizer, list(messages), tools, template_kwargs)
    if len(ids) != len(mask):  # a bug of this module, never the data's
        raise AssertionError(f"{mask_type} loss mask: {len(ids)} tokens, {len(mask)} mask entries")
    return ids, mask


def _each_alone(tokenizer: Tokenizer, messages: list[Message], tools: Tools,
                kwargs: dict[str, Any]) -> tuple[list[int], list[int]]:
    injected, header = _injected_system(tokenizer, kwargs), _generation_prompt(tokenizer, kwargs)
    ids: list[int] = []
    mask: list[int] = []
    for index, message in enumerate(messages):
        own = render(tokenizer, [message], add_generation_prompt=False, tools=tools if index == 0 else None, **kwargs)
        if index > 0 and message["role"] != "system":
            own = own[injected:]
        ids += own
        mask += _message_mask(message, len(own), header)
    return ids, mask


def _each_after_a_turn(tokenizer: Tokenizer, messages: list[Message], tools: Tools,
                       kwargs: dict[str, Any]) -> tuple[list[int], list[int]]:
    header = _generation_prompt(tokenizer, kwargs)
    before = render(tokenizer, [_STAND_IN], add_generation_prompt=False, **kwargs)
    stand_in_turn = len(before) - _injected_system(tokenizer, kwargs)  # without a default system prompt
    ids: list[int] = []
    mask: list[int] = []
    start = 0
    while start < len(messages):
        end = start + 1
        while messages[start]["role"] == "tool" and end < len(messages) and messages[end]["role"] == "tool":
            end += 1
        turn = messages[start:end]
        if start == 0:  # first: rendered before the stand-in turn (with the tools), which is then cut off
            own = render(tokenizer, [*turn, _STAND_IN], add_generation_prompt=False, tools=tools, **kwargs)
            own = own[:len(own) - stand_in_turn]
        else:
            own = render(tokenizer, [_STAND_IN, *turn], add_generation_prompt=False, **kwargs)[len(before):]
        ids += own
        mask += _message_mask(turn[0], len(own), header)
        start = end
    return ids, mask


def _first_and_last(tokenizer: Tokenizer, messages: list[Message], tools: Tools,
                    kwargs: dict[str, Any]) -> tuple[list[int], list[int]]:
    prompt_text = tokenizer.apply_chat_template([dict(messages[0])], add_generation_prompt=True, tokenize=False,
                                                **({"tools": list(tools)} if tools else {}), **kwargs)
    prompt = list(tokenizer(prompt_text, add_special_tokens=False)["input_ids"])
    response = list(tokenizer(messages[-1]["content"], add_special_tokens=False)["input_ids"])
    trained = 1 if messages[-1].get("step_loss_mask", 1) == 1 else 0
    return prompt + response, [0] * len(prompt) + [trained] * len(response)


def _by_characters(tokenizer: Tokenizer, messages: list[Message], tools: Tools,
                   kwargs: dict[str, Any]) -> tuple[list[int], list[int]]:
    text = tokenizer.apply_chat_template([dict(m) for m in messages], add_generation_prompt=False, tokenize=False,
                                         **({"tools": list(tools)} if tools else {}), **kwargs)
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError:  # a slow (Python) tokenizer has no character offsets
        encoded = {}
    offsets = encoded.get("offset_mapping")
    if offsets is None:
        raise ValueError(f"loss_mask_type 'qwen3_5' cuts the rendered conversation by characters and needs a fast "
                         f"tokenizer (character offsets); {type(tokenizer).__name__} gives none")
    ids = list(encoded["input_ids"])
    if ids != render(tokenizer, messages, add_generation_prompt=False, tools=tools, **kwargs):
        raise ValueError("loss_mask_type 'qwen3_5': the rendered conversation tokenises differently from the chat "
                         "template's own tokens, so character offsets would not line up with them")
    trained = [0] * (len(text) + 1)  # trained[i]: trained characters before position i
    cursor = 0
    for number, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        header = text.find(ASSISTANT_HEADER, cursor)
        end = -1 if header < 0 else text.find(TURN_END, header + len(ASSISTANT_HEADER))
        if end < 0:
            raise ValueError(f"loss_mask_type 'qwen3_5': message {number} (assistant) has no "
                             f"{ASSISTANT_HEADER!r}...{TURN_END!r} turn in the rendered conversation; the template is "
                             "not Qwen3.5's ChatML")
        closed = end + len(TURN_END)
        start, cursor = header + len(ASSISTANT_HEADER), closed + text.startswith("\n", closed)
        if message.get("step_loss_mask", 1) == 1:
            start += len(THINK_OPEN) if text.startswith(THINK_OPEN, start) else 0
            trained[start + 1:cursor + 1] = [1] * (cursor - start)
    for position in range(len(text)):
        trained[position + 1] += trained[position]
    return ids, [int(last > first and trained[last] > trained[first]) for first, last in offsets]


def _message_mask(message: Message, length: int, header: int) -> list[int]:
    if message["role"] != "assistant" or message.get("step_loss_mask", 1) != 1:
        return [0] * length
    return [0] * header + [1] * (length - header)


def _injected_system(tokenizer: Tokenizer, kwargs: dict[str, Any]) -> int:
    """Tokens the template puts before a conversation that has no system message (its default system prompt):
    one user turn renders as those tokens plus the turn, two as those plus the turn twice."""
    probe = {"role": "user", "content": _PROBE}
    once = render(tokenizer, [probe], add_generation_prompt=False, **kwargs)
    twice = render(tokenizer, [probe, probe], add_generation_prompt=False, **kwargs)
    return 2 * len(once) - len(twice)


def _generation_prompt(tokenizer: Tokenizer, kwargs: dict[str, Any]) -> int:
    """Tokens of the template's generation prompt: an assistant turn's header, which the model does not write."""
    probe = [{"role": "user", "content": _PROBE}]
    return (len(render(tokenizer, probe, add_generation_prompt=True, **kwargs))
            - len(render(tokenizer, probe, add_generation_prompt=False, **kwargs)))
