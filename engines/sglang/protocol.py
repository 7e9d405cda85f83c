"""The JSON both ends of SGLang's HTTP API exchange, in one place: our types <-> SGLang 0.5.x request fields.

Field names follow SGLang's `io_struct` (`GenerateReqInput`, `PauseGenerationReqInput`,
`InitWeightsUpdateGroupReqInput`, `UpdateWeightsFromDistributedReqInput`) and the sampling-parameter names of
its `SamplingParams`. The client (`client.py`) builds requests and parses responses with these functions; the
compatible server (`server.py`) parses requests and builds responses with them, so the two cannot drift apart.

Conventions of the mapping:

* `top_k`: ours uses 0 for "off", SGLang uses -1.
* Outputs must be token-exact for RL, so requests ask for `no_stop_trim` (a matched stop string stays in the
  output, as in our engines) and `skip_special_tokens=False`; token ids and log-probs are read from
  `meta_info.output_token_logprobs` (`[logprob, token_id, text]` triples), which SGLang fills for every
  generated token when `return_logprob` is true.
* Seeds: SGLang's `sampling_seed` seeds ONE sample's random stream, and SGLang gives every copy of an `n > 1`
  request the same one (so the copies would be identical). A seeded request with `n > 1` is therefore sent as a
  batch of `n` one-sample items, item `i` seeded with `derive_sample_seed(seed, i)`; with `n == 1` the seed is
  sent as is, so a seeded single sample through the compatible server equals the torch engine's exactly.
* Weight versions: SGLang tags a whole response with the server's `weight_version` string when the response
  is built. The initial version is the string "default", which we read as version 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from engines.inference.base import FinishReason, GenerateOutput, GenerateRequest, SamplingParams, derive_sample_seed

INITIAL_WEIGHT_VERSION = "default"
FINISH_TYPES: tuple[str, ...] = ("stop", "length", "abort")
# SGLang names dtypes as torch attribute names; these are the ones a weight update may carry.
WIRE_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float32",
        "bfloat16",
        "float16",
        "float64",
        "float8_e4m3fn",
        "float8_e5m2",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
    )
}


class ProtocolError(ValueError):
    """A request or response that does not have the shape SGLang's API gives it; the message says where."""


# ----------------------------------------------------------------------------------------------- requests


def sampling_params_json(params: SamplingParams, *, seed: int | None) -> dict[str, Any]:
    """One sample's SGLang `sampling_params` (n is always 1 here: see the module docstring on seeds)."""
    body: dict[str, Any] = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "max_new_tokens": params.max_new_tokens,
        "ignore_eos": params.ignore_eos,
        "no_stop_trim": True,
        "skip_special_tokens": False,
    }
    if params.stop:
        body["stop"] = list(params.stop)
    if params.stop_token_ids:
        body["stop_token_ids"] = list(params.stop_token_ids)
    if seed is not None:
        body["sampling_seed"] = seed
    return body


def wire_request_ids(request: GenerateRequest) -> list[str]:
    """The SGLang `rid` of each sample: the request id itself for one sample, `id/i` for sample i of several."""
    if request.params.n == 1:
        return [request.request_id]
    return [f"{request.request_id}/{index}" for index in range(request.params.n)]


def generate_json(request: GenerateRequest) -> dict[str, Any]:
    """The `/generate` body for `request`: one item for n == 1, a batch of n one-sample items otherwise."""
    params, seed = request.params, request.params.seed
    if params.n == 1:
        return {
            "rid": request.request_id,
            "input_ids": list(request.input_ids),
            "sampling_params": sampling_params_json(params, seed=seed),
            "return_logprob": True,
            "stream": False,
        }
    return {
        "rid": wire_request_ids(request),
        "input_ids": [list(request.input_ids) for _ in range(params.n)],
        "sampling_params": [
            sampling_params_json(params, seed=None if seed is None else derive_sample_seed(seed, index))
            for index in range(params.n)
        ],
        "return_logprob": True,
        "stream": False,
    }


@dataclass(frozen=True)
class GenerateItem:
    """One item of a `/generate` request as a server sees it."""

    rid: str
    input_ids: list[int] | None
    text: str | None
    params: SamplingParams
    return_logprob: bool


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
    items = []
    for index, prompt in enumerate(prompts):
        rid = rids[index] if rids[index] is not None else new_rid()
        if not isinstance(rid, str) or not rid:
            raise ProtocolError(f"/generate: rid of item {index} must be a non-empty string, got {rid!r}")
        ids = None if text is not None else _token_ids(prompt, index)
        if text is not None and not isinstance(prompt, str):
            raise ProtocolError(f"/generate: text of item {index} must be a string")
        items.append(
            GenerateItem(
                rid,
                ids,
                prompt if text is not None else None,
                parse_sampling_params(params[index], where=f"item {index}"),
                bool(logprob[index]),
            )
        )
    return items, batch


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
        )
    except (TypeError, ValueError) as error:
        raise ProtocolError(f"/generate: sampling_params of {where}: {error}") from error


# ---------------------------------------------------------------------------------------------- responses


def output_json(output: GenerateOutput, *, rid: str, weight_version: str, text: str) -> dict[str, Any]:
    """One generated sample as SGLang's `/generate` returns it (with `return_logprob`)."""
    finish: dict[str, Any] = {"type": output.finish_reason}
    if output.finish_reason == "stop" and output.matched_stop is not None:
        finish["matched"] = output.matched_stop
    elif output.finish_reason == "length":
        finish["length"] = len(output.output_ids)
    elif output.finish_reason == "abort":
        finish["message"] = "aborted"
    return {
        "text": text,
        "output_ids": list(output.output_ids),
        "meta_info": {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": output.prompt_len,
            "completion_tokens": len(output.output_ids),
            "output_token_logprobs": [
                [log_prob, token, None] for log_prob, token in zip(output.log_probs, output.output_ids, strict=True)
            ],
            "weight_version": weight_version,
        },
    }


@dataclass(frozen=True)
class ParsedOutput:
    """One sample of a `/generate` response, before versions are assigned."""

    output_ids: list[int]
    log_probs: list[float]
    finish_reason: FinishReason
    matched_stop: str | int | None
    weight_version: int | None
    prompt_tokens: int


def parse_output_json(item: Any, *, where: str) -> ParsedOutput:
    """One item of SGLang's `/generate` response -> tokens, log-probs, finish reason and weight version."""
    if not isinstance(item, dict) or not isinstance(item.get("meta_info"), dict):
        raise ProtocolError(f"{where}: expected an object with 'meta_info', got {str(item)[:200]!r}")
    meta = item["meta_info"]
    triples = meta.get("output_token_logprobs")
    if not isinstance(triples, list):
        raise ProtocolError(f"{where}: meta_info.output_token_logprobs missing (was return_logprob sent?)")
    try:
        log_probs = [float(entry[0]) for entry in triples]
        ids = [int(entry[1]) for entry in triples]
    except (TypeError, ValueError, IndexError) as error:
        raise ProtocolError(f"{where}: malformed output_token_logprobs entry ({error})") from error
    if not all(math.isfinite(value) for value in log_probs):
        raise ProtocolError(f"{where}: output_token_logprobs holds a non-finite log-prob")
    listed = item.get("output_ids")
    if isinstance(listed, list) and listed[: len(ids)] != ids:
        raise ProtocolError(f"{where}: output_ids disagree with the token ids of output_token_logprobs")
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind not in FINISH_TYPES:
        raise ProtocolError(f"{where}: finish_reason {finish!r} is none of {FINISH_TYPES}")
    matched = finish.get("matched") if isinstance(finish, dict) else None
    return ParsedOutput(
        output_ids=ids,
        log_probs=log_probs,
        finish_reason=kind,
        matched_stop=matched if isinstance(matched, (str, int)) else None,
        weight_version=parse_weight_version(meta.get("weight_version")),
        prompt_tokens=int(meta.get("prompt_tokens") or 0),
    )


def parse_weight_version(raw: Any) -> int | None:
    """SGLang's weight_version string -> our integer version; "default" (never updated) is 0, other text None."""
    if raw is None:
        return None
    if raw == INITIAL_WEIGHT_VERSION:
        return 0
    try:
        return int(raw)
    except (TypeError, ValueError):
        return None


def wire_dtype(name: Any, *, where: str) -> torch.dtype:
    if name not in WIRE_DTYPES:
        raise ProtocolError(f"{where}: dtype {name!r} is not one of {sorted(WIRE_DTYPES)}")
    return WIRE_DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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
