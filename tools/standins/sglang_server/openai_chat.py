"""`POST /v1/chat/completions` on the SGLang stand-in: the OpenAI-compatible route SGLang serves beside its own API,
which agent frameworks outside the run call (slime's rollout-buffer service's generators, through the OpenAI
client). The subset they send: `messages`, `max_tokens`, `temperature`, `top_p`, `seed`, `stop`, `n` 1, and
`continue_final_message` (slime's generators resume an aborted turn with it); `tools` and `stream` other than
off are refused with SGLang-shaped 400s naming the field, rather than answered wrongly.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from aiohttp import web

from engines.inference.base import GenerateRequest, SamplingParams
from engines.inference.torch_engine import TorchEngine

_ids = itertools.count()


def error(status: int, message: str) -> web.Response:
    return web.json_response({"object": "error", "message": message, "type": "BadRequestError", "code": status},
                             status=status)


def sampling(body: dict[str, Any]) -> SamplingParams:
    """The request's sampling, as SGLang's OpenAI adapter maps it; a bad value raises ValueError naming it."""
    for field in ("tools", "stream", "n"):
        if body.get(field) not in (None, False, 1, []):
            raise ValueError(f"/v1/chat/completions: {field}={body[field]!r} is not served by this stand-in")
    stop = body.get("stop") or ()
    return SamplingParams(temperature=float(body.get("temperature", 1.0)), top_p=float(body.get("top_p", 1.0)),
                          max_new_tokens=int(body.get("max_tokens") or body.get("max_completion_tokens") or 128),
                          stop=(stop,) if isinstance(stop, str) else tuple(stop), seed=body.get("seed"))


def prompt_ids(tokenizer: Any, body: dict[str, Any]) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("/v1/chat/completions: 'messages' must be a non-empty list of chat messages")
    extra = body.get("extra_body") or {}
    resume = bool(body.get("continue_final_message", extra.get("continue_final_message")))
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=not resume,
                                             continue_final_message=resume)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


async def chat_completions(engine: TorchEngine, request: web.Request, *, model: str,
                           context_length: int) -> web.Response:
    tokenizer = engine.tokenizer
    try:
        body = await request.json()
        params = sampling(body)
        ids = prompt_ids(tokenizer, body)
    except ValueError as problem:  # json.JSONDecodeError is one
        return error(400, str(problem))
    if len(ids) + params.max_new_tokens > context_length:
        return error(400, f"Requested token count exceeds the model's maximum context length of {context_length} "
                          f"tokens. You requested a total of {len(ids) + params.max_new_tokens} tokens: {len(ids)} "
                          f"tokens from the input messages and {params.max_new_tokens} tokens for the completion.")
    rid = f"chatcmpl-{next(_ids)}"
    (output,) = await engine.generate(GenerateRequest(rid, ids, params))
    text = tokenizer.decode(output.output_ids, skip_special_tokens=True)
    finish = output.finish_reason
    return web.json_response({
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
        "usage": {"prompt_tokens": len(ids), "completion_tokens": len(output.output_ids),
                  "total_tokens": len(ids) + len(output.output_ids)},
    })
