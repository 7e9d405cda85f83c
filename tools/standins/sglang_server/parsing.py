"""The server's half of SGLang's `/generate` JSON: parse a request body, build a response item.

Only the compatible server (`server.py`) needs these; the client's half (building requests, parsing responses)
is in `protocol.py`, beside the table of endpoints both use.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from engines.inference.base import GenerateOutput, GenerateRequest, RoutedExperts, SamplingParams
from engines.sglang.protocol import ProtocolError

# SGLang's tp_worker keeps 5 tokens of a request's length for itself: max_req_input_len = max_req_len - 5.
RESERVED_INPUT_TOKENS = 5


@dataclass(frozen=True)
class GenerateItem:
    """One item of a `/generate` request as a server sees it."""

    rid: str
    input_ids: list[int] | None
    text: str | None
    params: SamplingParams
    return_logprob: bool
    lora_path: str | None = None  # the name of the loaded adapter the item runs with; None: the base model
    # max_new_tokens 0: nothing is generated, the prompt is scored from logprob_start_len (`input_token_logprobs`)
    score_only: bool = False
    logprob_start_len: int = -1
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    images: tuple[bytes, ...] = ()  # `image_data`, decoded (a vision-language model's prompt)


def parse_generate_json(body: Any, *, new_rid: Any) -> tuple[list[GenerateItem], bool]:
    """A `/generate` body -> its items and whether it was a batch. `new_rid()` names items that have no rid.

    Accepts the single and the batch form, `input_ids` or `text`; raises ProtocolError naming the field.
    """
    if not isinstance(body, dict):
        raise ProtocolError(f"/generate: body must be a JSON object, got {type(body).__name__}")
    if body.get("stream"):
        raise ProtocolError("/generate: stream=true is not supported by this server")
    input_ids, text = body.get("input_ids"), body.get("text")
    if (input_ids is None) == (text is None):
        raise ProtocolError("/generate: give exactly one of 'input_ids' and 'text'")
    batch = isinstance(text, list) if text is not None else bool(input_ids) and isinstance(input_ids[0], list)
    prompts: list[Any] = (
        (text if text is not None else input_ids) if batch else [text if text is not None else input_ids]
    )
    size = len(prompts)
    rid = body.get("rid")
    # As in SGLang, one string rid for a batch is a prefix of per-item ids.
    rids = (
        [f"{rid}_{index}" for index in range(size)] if batch and isinstance(rid, str) else _per_item(rid, size, "rid")
    )
    params = _per_item(body.get("sampling_params") or {}, size, "sampling_params")
    logprob = _per_item(body.get("return_logprob", False), size, "return_logprob")
    adapters = _per_item(body.get("lora_path"), size, "lora_path")
    starts = _per_item(body.get("logprob_start_len", -1), size, "logprob_start_len")
    images = _item_images(body.get("image_data"), size, batch)
    want_routes = bool(body.get("return_routed_experts", False))  # one switch for the whole request, as SGLang's
    routes_from = body.get("routed_experts_start_len", 0)
    if not isinstance(routes_from, int) or isinstance(routes_from, bool) or routes_from < 0:
        raise ProtocolError(f"/generate: routed_experts_start_len must be an int >= 0, got {routes_from!r}")
    items = []
    for index, prompt in enumerate(prompts):
        rid = rids[index] if rids[index] is not None else new_rid()
        if not isinstance(rid, str) or not rid:
            raise ProtocolError(f"/generate: rid of item {index} must be a non-empty string, got {rid!r}")
        ids = None if text is not None else _token_ids(prompt, index)
        if text is not None and not isinstance(prompt, str):
            raise ProtocolError(f"/generate: text of item {index} must be a string")
        if adapters[index] is not None and (not isinstance(adapters[index], str) or not adapters[index]):
            raise ProtocolError(f"/generate: lora_path of item {index} must be an adapter's name, "
                                f"got {adapters[index]!r}")
        raw_params = params[index] if isinstance(params[index], dict) else {}
        score_only = raw_params.get("max_new_tokens") == 0
        if score_only:  # SGLang scores the prompt and generates nothing; our params need one token to be valid
            raw_params = {**raw_params, "max_new_tokens": 1}
        start = starts[index]
        if not isinstance(start, int) or isinstance(start, bool) or start < -1:
            raise ProtocolError(f"/generate: logprob_start_len of item {index} must be an int >= -1, got {start!r}")
        items.append(
            GenerateItem(
                rid,
                ids,
                prompt if text is not None else None,
                parse_sampling_params(raw_params if score_only else params[index], where=f"item {index}"),
                bool(logprob[index]),
                adapters[index],
                score_only=score_only,
                logprob_start_len=start,
                return_routed_experts=want_routes,
                routed_experts_start_len=routes_from,
                images=images[index],
            )
        )
    return items, batch


def _item_images(image_data: Any, size: int, batch: bool) -> list[tuple[bytes, ...]]:
    """Each item's images from SGLang's `image_data` (one item: a URL or a list; a batch: a list per item). Only
    `data:` URLs: this server reads no file and no network."""
    if image_data is None:
        return [()] * size
    per_item = image_data if batch else [image_data]
    if not isinstance(per_item, list) or len(per_item) != size:
        raise ProtocolError(f"/generate: image_data must give each of the {size} item(s) its images")
    decoded = []
    for index, item in enumerate(per_item):
        urls = item if isinstance(item, list) else [item]
        images = []
        for url in urls:
            if not isinstance(url, str) or not url.startswith("data:") or ";base64," not in url:
                raise ProtocolError(f"/generate: image_data of item {index} must be data: URLs with base64 "
                                    f"images; got {str(url)[:40]!r}")
            try:
                images.append(base64.b64decode(url.split(",", 1)[1], validate=True))
            except binascii.Error as error:
                raise ProtocolError(f"/generate: image_data of item {index}: bad base64 ({error})") from None
        decoded.append(tuple(images))
    return decoded


def parse_sampling_params(raw: Any, *, where: str) -> SamplingParams:
    """SGLang `sampling_params` -> ours; unknown keys are ignored as SGLang's defaults would leave them."""
    if not isinstance(raw, dict):
        raise ProtocolError(f"/generate: sampling_params of {where} must be an object, got {type(raw).__name__}")
    top_k = raw.get("top_k", -1)
    stop = raw.get("stop") or ()
    try:
        return SamplingParams(
            temperature=float(raw.get("temperature", 1.0)),
            top_p=float(raw.get("top_p", 1.0)),
            top_k=0 if top_k is None or top_k < 0 else int(top_k),
            max_new_tokens=int(raw.get("max_new_tokens", 128)),
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            stop_token_ids=tuple(raw.get("stop_token_ids") or ()),
            n=int(raw.get("n", 1)),
            seed=raw.get("sampling_seed"),
            ignore_eos=bool(raw.get("ignore_eos", False)),
            min_new_tokens=int(raw.get("min_new_tokens") or 0),
        )
    except (TypeError, ValueError) as error:
        raise ProtocolError(f"/generate: sampling_params of {where}: {error}") from error


def check_context(request: GenerateRequest, context: int) -> None:
    """SGLang's tokenizer-manager and scheduler checks, with SGLang's words; each is an HTTP 400 there."""
    prompt = len(request.input_ids)
    if prompt >= context:
        raise ValueError(f"The input ({prompt} tokens) is longer than the model's context length ({context} tokens).")
    total = prompt + request.params.max_new_tokens
    if total > context:
        raise ValueError(
            f"Requested token count exceeds the model's maximum context length of {context} tokens. You "
            f"requested a total of {total} tokens: {prompt} tokens from the input messages and "
            f"{request.params.max_new_tokens} tokens for the completion."
        )
    max_input = context - 1 - RESERVED_INPUT_TOKENS
    if prompt >= max_input:
        raise ValueError(f"Input length ({prompt} tokens) exceeds the maximum allowed length ({max_input} tokens).")


# ---------------------------------------------------------------------------------------------- responses


def output_json(
    output: GenerateOutput,
    *,
    rid: str,
    weight_version: str,
    text: str,
    weight_versions: list[dict[str, Any]] | None = None,
    routed_experts: str | None = None,
    e2e_latency: float = 0.0,
) -> dict[str, Any]:
    """One generated sample as SGLang's `/generate` returns it (with `return_logprob`). `cached_tokens` and
    `e2e_latency` (seconds from arrival to finish) are SGLang's too: agent frameworks that talk to its /generate
    (strands-sglang) report them as usage and read them unconditionally."""
    finish: dict[str, Any] = {"type": output.finish_reason}
    if output.finish_reason == "stop" and output.matched_stop is not None:
        finish["matched"] = output.matched_stop
    elif output.finish_reason == "length":
        finish["length"] = len(output.output_ids)
    elif output.finish_reason == "abort":
        finish["message"] = "aborted"
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish,
        "prompt_tokens": output.prompt_len,
        "completion_tokens": len(output.output_ids),
        "cached_tokens": output.cached_tokens,
        "e2e_latency": e2e_latency,
        "output_token_logprobs": [
            [log_prob, token, None] for log_prob, token in zip(output.log_probs, output.output_ids, strict=True)
        ],
        "weight_version": weight_version,
    }
    if weight_versions is not None:
        meta["weight_versions"] = weight_versions
    if routed_experts is not None:
        meta["routed_experts"] = routed_experts
    return {"text": text, "output_ids": list(output.output_ids), "meta_info": meta}


def routed_experts_base64(routes: RoutedExperts | None, start: int) -> str | None:
    """An output's routes as SGLang sends them: base64 of int32 [tokens from `start` on, layers, top_k]."""
    if routes is None:
        return None
    return base64.b64encode(routes.table()[start:].astype("<i4").tobytes()).decode("ascii")


def scored_json(input_ids: list[int], log_probs: list[float], *, start: int, rid: str,
                weight_version: str) -> dict[str, Any]:
    """A `max_new_tokens: 0` item as SGLang answers it: `input_token_logprobs` has one [log-prob, id, None] entry
    per token from `start` on, the first one's log-prob None (nothing before it was scored), nothing generated."""
    ids = input_ids[start:]
    values: list[float | None] = [None, *log_probs] if ids else []
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": {"type": "length", "length": 0},
        "prompt_tokens": len(input_ids),
        "completion_tokens": 0,
        "input_token_logprobs": [[value, token, None] for value, token in zip(values, ids, strict=True)],
        "output_token_logprobs": [],
        "weight_version": weight_version,
    }
    return {"text": "", "output_ids": [], "meta_info": meta}


def version_spans(versions: list[str]) -> list[dict[str, Any]]:
    """Per-token version names -> SGLang 0.5.23's `weight_versions` spans (end exclusive, runs merged)."""
    spans: list[dict[str, Any]] = []
    for index, name in enumerate(versions):
        if spans and spans[-1]["version"] == name:
            spans[-1]["end"] = index + 1
        else:
            spans.append({"version": name, "start": index, "end": index + 1})
    return spans


def _per_item(value: Any, size: int, field_name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != size:
            raise ProtocolError(f"/generate: {field_name} lists {len(value)} entries for {size} prompts")
        return value
    return [value] * size


def _token_ids(prompt: Any, index: int) -> list[int]:
    if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) and t >= 0 for t in prompt):
        raise ProtocolError(f"/generate: input_ids of item {index} must be a non-empty list of ints >= 0")
    return prompt


async def request_json(request: web.Request) -> dict[str, Any]:
    """A route's JSON object body ({} when it has none); HTTP 400 naming the path when it is not one."""
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except ValueError as error:
        raise web.HTTPBadRequest(text=f"{request.path}: body is not JSON ({error})") from error
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text=f"{request.path}: body must be a JSON object")
    return body
