"""The JSON both ends of SGLang's HTTP API exchange, in one place: our types <-> SGLang 0.5.x request fields.

Field names follow SGLang's `io_struct` (`GenerateReqInput`, `PauseGenerationReqInput`,
`InitWeightsUpdateGroupReqInput`, `UpdateWeightsFromDistributedReqInput`, ...) and the sampling-parameter names of
its `SamplingParams`. Every endpoint the client calls is a row of `ENDPOINTS` below (method, path, SGLang's
request class, the body fields we send, the response fields we read). The client (`client.py`) builds requests
and parses responses with these functions and calls endpoints through these rows; the CPU stand-in server
(`tools/standins/sglang_server/`) registers its routes from the same rows and reads requests with its `parsing.py`; and
`tests/engines/test_sglang_contract.py` checks every row against the source of the SGLang releases we support
(`SUPPORTED_SGLANG`), so the three cannot drift apart.

Conventions of the mapping:

* `top_k`: ours uses 0 for "off", SGLang uses -1.
* Outputs must be token-exact for RL, so requests ask for `no_stop_trim` (a matched stop string stays in the
  output, as in our engines) and `skip_special_tokens=False`; token ids and log-probs are read from
  `meta_info.output_token_logprobs` (`[logprob, token_id, text]` triples), which SGLang fills for every
  generated token when `return_logprob` is true. A request SGLang aborts before its prefill comes back without
  them; that is an aborted sample with no tokens, not a protocol error.
* Request ids: SGLang aborts by PREFIX (`/abort_request {"rid": r}` ends every request whose rid starts with
  `r`), so our ids go on the wire in a prefix-free form (`wire_rid`): aborting one request never touches
  `id/10` when it meant `id/1`, nor the request's own resumptions.
* Seeds: SGLang's `sampling_seed` seeds ONE sample's random stream, and SGLang gives every copy of an `n > 1`
  request the same one (so the copies would be identical). A seeded request with `n > 1` is therefore sent as a
  batch of `n` one-sample items, item `i` seeded with `derive_sample_seed(seed, i)`; with `n == 1` the seed is
  sent as is. SGLang honours `sampling_seed` only on a server started with `--enable-deterministic-inference`
  (`sampling_batch_info.py` builds the seed tensor only then); elsewhere seeded samples are not reproducible.
* Weight versions: the server's `weight_version` string is what the last update set; "default" (never updated)
  reads as version 0. SGLang 0.5.23 also returns `meta_info.weight_versions`, spans
  `{"version", "start", "end"}` over the output tokens (end exclusive) saying which weights produced each token;
  `token_versions` turns them into one version per token. Older releases tag the whole response with one
  `weight_version`.
* Weight checksums: `/weights_checker` with action "checksum" hashes what the server serves, in SGLang's own
  layout; we read `per_engine_checksum` and check that it is the one its ranks' `per_gpu_checksum` give.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from engines.inference.base import FinishReason, GenerateRequest, SamplingParams, derive_sample_seed

INITIAL_WEIGHT_VERSION = "default"
FINISH_TYPES: tuple[str, ...] = ("stop", "length", "abort")
if TYPE_CHECKING:
    import torch

# SGLang names dtypes as torch attribute names; these are the ones a weight update may carry. Names, not dtypes:
# the launcher reads this module while it checks a run's settings, before torch is imported anywhere.
WIRE_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16", "float64", "float8_e4m3fn", "float8_e5m2",
                                "int64", "int32", "int16", "int8", "uint8", "bool")


class ProtocolError(ValueError):
    """A request or response that does not have the shape SGLang's API gives it; the message says where."""


# ----------------------------------------------------------------------------------------------- the table

# The SGLang releases the client is tested against (contract tests read both wheels' source); pyproject's
# `sglang` extra allows exactly this range.
SUPPORTED_SGLANG: tuple[str, ...] = ("0.5.15.post1", "0.5.23")


@dataclass(frozen=True)
class Endpoint:
    """One SGLang HTTP endpoint as we use it.

    `request_class` is the SGLang class its JSON body is parsed into (`io_struct.py`; None: no body), `sends`
    the body fields we send, `reads` the response fields we read. `optional` endpoints are missing from some
    supported release (their `since`); the client detects the 404 and falls back, and says so in its log.
    """

    method: Literal["GET", "POST"]
    path: str
    request_class: str | None = None
    sends: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()
    optional: bool = False
    since: str | None = None


# What every weight-update endpoint answers, and what the LoRA adapter endpoints answer.
_DONE = ("success", "message")
_ADAPTER_DONE = ("success", "error_message")

GENERATE = Endpoint(
    "POST", "/generate", "GenerateReqInput",
    sends=("rid", "input_ids", "sampling_params", "return_logprob", "stream", "lora_path", "return_routed_experts",
           "routed_experts_start_len", "image_data"),
    reads=("output_ids", "meta_info"),
)
# Sent for routing replay; 0.5.23's /generate schema gate does not list it but ignores unknown keys, and the
# request object the server builds (`GenerateReqInput`) has it in every supported release.
UNGATED_GENERATE_FIELDS: tuple[str, ...] = ("return_routed_experts",)
# meta_info's routed experts (with `return_routed_experts` and a server started with --enable-return-routed-experts):
# base64 of int32 [tokens from routed_experts_start_len to the sequence's last but one, layers, top_k]
ROUTED_EXPERTS_META = "routed_experts"
ROUTED_EXPERTS_FLAG = "enable-return-routed-experts"
ABORT = Endpoint("POST", "/abort_request", "AbortReq", sends=("rid", "abort_all"))
PAUSE = Endpoint("POST", "/pause_generation", "PauseGenerationReqInput", sends=("mode",))
CONTINUE = Endpoint("POST", "/continue_generation", "ContinueGenerationReqInput")
FLUSH_CACHE = Endpoint("GET", "/flush_cache")
HEALTH = Endpoint("GET", "/health")
HEALTH_GENERATE = Endpoint("GET", "/health_generate")
MODEL_INFO = Endpoint("GET", "/model_info", reads=("weight_version", "model_path"))
SERVER_INFO = Endpoint("GET", "/server_info",
                       reads=("context_length", "max_req_input_len", "enable_deterministic_inference",
                              "max_loras_per_batch", "max_loaded_loras"))
INIT_WEIGHTS_GROUP = Endpoint(
    "POST", "/init_weights_update_group", "InitWeightsUpdateGroupReqInput",
    sends=("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"), reads=_DONE,
)
DESTROY_WEIGHTS_GROUP = Endpoint("POST", "/destroy_weights_update_group", "DestroyWeightsUpdateGroupReqInput",
                                 sends=("group_name",), reads=_DONE)
BEGIN_WEIGHT_UPDATE = Endpoint("POST", "/begin_weight_update", "BeginWeightUpdateReqInput", sends=("selector",),
                               reads=_DONE, optional=True, since="0.5.23")
END_WEIGHT_UPDATE = Endpoint("POST", "/end_weight_update", "EndWeightUpdateReqInput", reads=_DONE, optional=True,
                             since="0.5.23")
UPDATE_WEIGHTS_FROM_DISTRIBUTED = Endpoint(
    "POST", "/update_weights_from_distributed", "UpdateWeightsFromDistributedReqInput",
    sends=("names", "dtypes", "shapes", "group_name", "weight_version", "flush_cache"), reads=_DONE,
)
# A colocated server (--colocate) shares the learner's device: a weight update hands it tensors by reference to the
# learner's memory (`tensor_payload.py`: base64 pickles of handles, one entry per tensor-parallel rank), and between
# turns it releases its memory (the tags below) while the learner trains, and resumes it before it generates.
UPDATE_WEIGHTS_FROM_TENSOR = Endpoint(
    "POST", "/update_weights_from_tensor", "UpdateWeightsFromTensorReqInput",
    sends=("serialized_named_tensors", "load_format", "flush_cache", "weight_version"), reads=_DONE,
)
# A server the learner shares only a folder with (--weight-transport disk) reloads each push from it in place: the
# folder holds safetensors files under checkpoint names (`disk_weights.py`); one call per push.
UPDATE_WEIGHTS_FROM_DISK = Endpoint(
    "POST", "/update_weights_from_disk", "UpdateWeightFromDiskReqInput",
    sends=("model_path", "weight_version", "flush_cache"), reads=_DONE,
)
RELEASE_MEMORY = Endpoint("POST", "/release_memory_occupation", "ReleaseMemoryOccupationReqInput", sends=("tags",))
RESUME_MEMORY = Endpoint("POST", "/resume_memory_occupation", "ResumeMemoryOccupationReqInput", sends=("tags",))
MEMORY_WEIGHTS, MEMORY_KV_CACHE, MEMORY_CUDA_GRAPH = "weights", "kv_cache", "cuda_graph"  # SGLang's constants.py
MEMORY_TAGS: tuple[str, ...] = (MEMORY_WEIGHTS, MEMORY_KV_CACHE, MEMORY_CUDA_GRAPH)
# LoRA adapters by name: a run that trains an adapter loads each version from a PEFT folder the rollout worker
# writes (`adapter_sync.py`), and a `/generate` item names the adapter it runs with in `lora_path`.
LOAD_LORA_ADAPTER = Endpoint("POST", "/load_lora_adapter", "LoadLoRAAdapterReqInput", sends=("lora_name", "lora_path"),
                             reads=_ADAPTER_DONE)
UNLOAD_LORA_ADAPTER = Endpoint("POST", "/unload_lora_adapter", "UnloadLoRAAdapterReqInput", sends=("lora_name",),
                               reads=_ADAPTER_DONE)
# SGLang's own check of the weights a server serves (`utils/weight_checker.py`): action "checksum" answers, per
# tensor-parallel rank (`ranks`), a checksum of every parameter and buffer in SGLang's layout (fused q/k/v and
# gate/up, sharded, its names) and their `per_gpu_checksum`, and `per_engine_checksum` over the ranks. What the
# learner sent cannot be compared with it tensor by tensor; engines of one push, and one engine across pushes, can
# (`checksums.py`).
WEIGHTS_CHECKER = Endpoint("POST", "/weights_checker", "CheckWeightsReqInput", sends=("action",),
                           reads=("success", "message", "ranks", "per_engine_checksum"))
CHECKSUM_ACTION = "checksum"
ENDPOINTS: tuple[Endpoint, ...] = (
    GENERATE,
    ABORT,
    PAUSE,
    CONTINUE,
    FLUSH_CACHE,
    HEALTH,
    HEALTH_GENERATE,
    MODEL_INFO,
    SERVER_INFO,
    INIT_WEIGHTS_GROUP,
    DESTROY_WEIGHTS_GROUP,
    BEGIN_WEIGHT_UPDATE,
    END_WEIGHT_UPDATE,
    UPDATE_WEIGHTS_FROM_DISTRIBUTED,
    UPDATE_WEIGHTS_FROM_TENSOR,
    UPDATE_WEIGHTS_FROM_DISK,
    RELEASE_MEMORY,
    RESUME_MEMORY,
    LOAD_LORA_ADAPTER,
    UNLOAD_LORA_ADAPTER,
    WEIGHTS_CHECKER,
)
# The keys of one `sampling_params` object we send (SGLang's `SamplingParams` fields).
SAMPLING_FIELDS: tuple[str, ...] = (
    "temperature",
    "top_p",
    "top_k",
    "max_new_tokens",
    "ignore_eos",
    "no_stop_trim",
    "skip_special_tokens",
    "stop",
    "stop_token_ids",
    "sampling_seed",
    "min_new_tokens",
)
# The module names SGLang can put an adapter on (`SUPPORTED_LORA_TARGET_MODULES`, the same in every supported
# release) and its word for all of them; a LoRA run on SGLang adapts only these.
LORA_TARGET_MODULES: tuple[str, ...] = (
    "q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "wq_b", "wk",
    "weights_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj", "embed_tokens", "lm_head",
)  # fmt: skip
LORA_ALL_MODULES = "all"
# SGLang's default `--max-loras-per-batch`: the adapters one running batch mixes, the base model's rows counting as
# one (the same in every supported release); more wait for a place in the batch.
LORAS_PER_BATCH = 8


def policies_room(loras_per_batch: int, max_loaded_loras: int | None = None) -> int:
    """How many policies' adapters a server started with `--max-loras-per-batch` (and `--max-loaded-loras`, which
    caps the adapters it holds at all) has room for: each policy holds its adapter and, while a push lands, the one
    it replaces, and the base model's rows take a place in every batch."""
    room = (loras_per_batch - 1) // 2
    return room if max_loaded_loras is None else min(room, max_loaded_loras // 2)


# What we read from a `/generate` item's `meta_info`; `weight_versions` only where the server sends it.
META_FIELDS: tuple[str, ...] = ("finish_reason", "output_token_logprobs", "weight_version", "prompt_tokens")
OPTIONAL_META_FIELDS: tuple[str, ...] = ("weight_versions",)
# The pause mode we put on the wire for every pause (see client.py: SGLang's "abort", slime's choice).
WIRE_PAUSE_MODE = "abort"


def request_body(endpoint: Endpoint, **fields: Any) -> dict[str, Any]:
    """The JSON body for `endpoint`; a field the table does not list is a bug here, not at the server."""
    unknown = sorted(set(fields) - set(endpoint.sends))
    if unknown:
        raise ProtocolError(f"{endpoint.path}: fields {unknown} are not in the protocol table ({endpoint.sends})")
    return fields


# -------------------------------------------------------------------------------------------- request ids

_RID_END = "#"


def wire_rid(request_id: str, sample_index: int) -> str:
    """The SGLang `rid` of sample `sample_index` of our request `request_id`, prefix-free.

    SGLang's scheduler aborts every request whose rid STARTS WITH the rid it is given. Our ids nest (a
    resumption is `id/resume...`, sample i of `id/1` vs `id/10`), so they cannot go on the wire as they are.
    `%` and `#` inside the id are escaped and the wire rid is `<escaped id>#<index>#`: every wire rid holds
    exactly two `#`, the last at its end, so none is a proper prefix of another, and the mapping is one-to-one.
    """
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request id must be a non-empty string, got {request_id!r}")
    escaped = request_id.replace("%", "%25").replace(_RID_END, "%23")
    return f"{escaped}{_RID_END}{sample_index}{_RID_END}"


# ----------------------------------------------------------------------------------------------- requests


def sampling_params_json(params: SamplingParams, *, seed: int | None) -> dict[str, Any]:
    """One sample's SGLang `sampling_params` (n is always 1 here: see the module docstring on seeds)."""
    fields: dict[str, Any] = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "max_new_tokens": params.max_new_tokens,
        "ignore_eos": params.ignore_eos,
        "no_stop_trim": True,
        "skip_special_tokens": False,
    }
    if params.stop:
        fields["stop"] = list(params.stop)
    if params.stop_token_ids:
        fields["stop_token_ids"] = list(params.stop_token_ids)
    if seed is not None:
        fields["sampling_seed"] = seed
    if params.min_new_tokens:
        fields["min_new_tokens"] = params.min_new_tokens
    return fields


def wire_request_ids(request: GenerateRequest) -> list[str]:
    """The SGLang `rid` of each sample of `request` (see `wire_rid`)."""
    return [wire_rid(request.request_id, index) for index in range(request.params.n)]


def generate_json(request: GenerateRequest, *, adapter: str | None = None,
                  routes_from: int | None = None) -> dict[str, Any]:
    """The `/generate` body for `request`: one item for n == 1, a batch of n one-sample items otherwise.

    `adapter` names a loaded LoRA adapter every item runs with (SGLang takes the NAME in `lora_path`).
    `routes_from`: ask for the routed experts of the tokens from this position on (routing replay)."""
    params, seed = request.params, request.params.seed
    rids = wire_request_ids(request)
    lora: dict[str, Any] = {} if adapter is None else {"lora_path": adapter}
    if routes_from is not None:
        lora.update(return_routed_experts=True, routed_experts_start_len=routes_from)
    if request.images:
        images = [image_data_url(image) for image in request.images]
        lora["image_data"] = images if params.n == 1 else [images] * params.n
    if params.n == 1:
        return request_body(
            GENERATE,
            rid=rids[0],
            input_ids=list(request.input_ids),
            sampling_params=sampling_params_json(params, seed=seed),
            return_logprob=True,
            stream=False,
            **lora,
        )
    return request_body(
        GENERATE,
        rid=rids,
        input_ids=[list(request.input_ids) for _ in range(params.n)],
        sampling_params=[
            sampling_params_json(params, seed=None if seed is None else derive_sample_seed(seed, index))
            for index in range(params.n)
        ],
        return_logprob=True,
        stream=False,
        **lora,
    )


def image_data_url(image: bytes) -> str:
    """An encoded image as a `data:` URL, the one form of `image_data` every supported release reads without a file
    system or network (`load_image`: URL, file://, data:, path or raw base64). The prompt's tokens go as they are:
    SGLang's Qwen-VL processor takes a run of `<|image_pad|>` between the vision markers as one image and expands it
    again from the image's size, the same count we expanded to (the grid depends on the size only)."""
    kind = next((mime for magic, mime in _IMAGE_MAGIC if image.startswith(magic)), "application/octet-stream")
    return f"data:{kind};base64,{base64.b64encode(image).decode('ascii')}"


_IMAGE_MAGIC = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF8", "image/gif"),
                (b"RIFF", "image/webp"), (b"BM", "image/bmp"))


def lora_target_modules(target_modules: tuple[str, ...] | list[str]) -> list[str]:
    """The server's `--lora-target-modules` for a run's `--target-modules`; a ValueError names what SGLang lacks."""
    if tuple(target_modules) == ("all-linear",):
        return [LORA_ALL_MODULES]
    unknown = [name for name in target_modules if name not in LORA_TARGET_MODULES]
    if unknown:
        raise ValueError(f"target_modules {unknown}: SGLang cannot adapt these; it adapts {list(LORA_TARGET_MODULES)} "
                         "(or give all-linear)")
    return list(target_modules)


# ---------------------------------------------------------------------------------------------- responses


@dataclass(frozen=True)
class ParsedOutput:
    """One sample of a `/generate` response, before versions are assigned.

    `token_versions` is one entry per output token when the server sent `weight_versions` spans (an entry is
    None where a span's version is not one of ours), else None.
    """

    output_ids: list[int]
    log_probs: list[float]
    finish_reason: FinishReason
    matched_stop: str | int | None
    weight_version: int | None
    prompt_tokens: int
    token_versions: list[int | None] | None = None
    routed_experts: bytes | None = None  # int32 little-endian, as meta_info carries it (decoded from base64)


def parse_output_json(item: Any, *, where: str) -> ParsedOutput:
    """One item of SGLang's `/generate` response -> tokens, log-probs, finish reason and weight versions."""
    if not isinstance(item, dict) or not isinstance(item.get("meta_info"), dict):
        raise ProtocolError(f"{where}: expected an object with 'meta_info', got {str(item)[:200]!r}")
    meta = item["meta_info"]
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind not in FINISH_TYPES:
        raise ProtocolError(f"{where}: finish_reason {finish!r} is none of {FINISH_TYPES}")
    triples = meta.get("output_token_logprobs")
    if triples is None and kind == "abort":
        # Aborted before its prefill (or before any log-prob was recorded): SGLang sends no log-probs, and
        # tokens without log-probs are no use to RL, so this is an aborted sample with nothing generated.
        return ParsedOutput([], [], "abort", None, parse_weight_version(meta.get("weight_version")), 0, None)
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
    matched = finish.get("matched") if isinstance(finish, dict) else None
    spans = meta.get("weight_versions")
    return ParsedOutput(
        output_ids=ids,
        log_probs=log_probs,
        finish_reason=kind,
        matched_stop=matched if isinstance(matched, (str, int)) else None,
        weight_version=parse_weight_version(meta.get("weight_version")),
        prompt_tokens=int(meta.get("prompt_tokens") or 0),
        token_versions=None if spans is None else token_versions(spans, len(ids), where=where),
        routed_experts=_routed_experts(meta.get(ROUTED_EXPERTS_META), where=where),
    )


def _routed_experts(encoded: Any, *, where: str) -> bytes | None:
    if encoded is None:
        return None
    if not isinstance(encoded, str):
        raise ProtocolError(f"{where}: meta_info.{ROUTED_EXPERTS_META} must be a base64 string, got "
                            f"{type(encoded).__name__}")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as error:
        raise ProtocolError(f"{where}: meta_info.{ROUTED_EXPERTS_META} is not base64 ({error})") from error
    if len(raw) % 4:
        raise ProtocolError(f"{where}: meta_info.{ROUTED_EXPERTS_META} holds {len(raw)} bytes, not int32s")
    return raw


def token_versions(spans: Any, num_tokens: int, *, where: str) -> list[int | None]:
    """SGLang's `weight_versions` spans -> one version per output token.

    The spans must be `{"version": str, "start": int, "end": int}` objects, in order, starting at 0, each
    starting where the previous ended. Tokens past the last span (SGLang clips spans to the tokens it returned,
    so there should be none) and spans whose version is not ours read as None.
    """
    if not isinstance(spans, list):
        raise ProtocolError(f"{where}: meta_info.weight_versions must be a list, got {type(spans).__name__}")
    versions: list[int | None] = []
    for position, span in enumerate(spans):
        if (
            not isinstance(span, dict)
            or not isinstance(span.get("start"), int)
            or not isinstance(span.get("end"), int)
            or not isinstance(span.get("version"), str)
        ):
            raise ProtocolError(f"{where}: meta_info.weight_versions[{position}] is not a span object: {span!r}")
        start, end = span["start"], min(span["end"], num_tokens)
        if start != len(versions) and not (start >= num_tokens and len(versions) == num_tokens):
            raise ProtocolError(
                f"{where}: meta_info.weight_versions[{position}] starts at {start}, expected {len(versions)}"
            )
        versions.extend([parse_weight_version(span["version"])] * max(0, end - start))
    return versions + [None] * (num_tokens - len(versions))


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


@dataclass(frozen=True)
class WeightsChecksum:
    """A server's answer to `/weights_checker` "checksum": `per_engine_checksum`, each rank's `per_gpu_checksum`
    it was computed from (rank order), and each rank's checksum per tensor (`name`, or `name@rank<r>` when the
    server has several ranks; empty where a rank gave none)."""

    engine: str
    ranks: tuple[str, ...]
    tensors: Mapping[str, str] = field(default_factory=dict)


def engine_checksum(per_gpu: Iterable[str]) -> str:
    """SGLang's `per_engine_checksum`: sha256 over the ranks' `per_gpu_checksum` hex strings, in rank order
    (`tokenizer_control_mixin.check_weights`, the same in every supported release)."""
    digest = hashlib.sha256()
    for checksum in per_gpu:
        digest.update(checksum.encode())
    return digest.hexdigest()


def parse_weights_checksum(body: Any, *, where: str) -> WeightsChecksum:
    """A `/weights_checker` "checksum" answer -> the engine's checksum and its ranks'. The engine's checksum must
    be the one its ranks give (`engine_checksum`): a server whose answer does not add up checks nothing."""
    if not isinstance(body, dict):
        raise ProtocolError(f"{where}: expected a JSON object, got {str(body)[:200]!r}")
    checksum, ranks = body.get("per_engine_checksum"), body.get("ranks")
    if not _is_sha256(checksum):
        raise ProtocolError(f"{where}: per_engine_checksum {checksum!r:.80} is not a sha256 hex digest "
                            f"(message: {str(body.get('message'))[:200]!r})")
    if (not isinstance(ranks, list) or not ranks
            or not all(isinstance(rank, dict) and _is_sha256(rank.get("per_gpu_checksum")) for rank in ranks)):
        raise ProtocolError(f"{where}: 'ranks' must be a non-empty list of objects with a sha256 per_gpu_checksum, "
                            f"got {str(ranks)[:200]!r}")
    per_gpu = tuple(rank["per_gpu_checksum"] for rank in ranks)
    if engine_checksum(per_gpu) != checksum:
        raise ProtocolError(f"{where}: per_engine_checksum is not the sha256 of its {len(per_gpu)} ranks' "
                            "per_gpu_checksum")
    tensors: dict[str, str] = {}
    for index, rank in enumerate(ranks):
        named = rank.get("checksums")
        if not isinstance(named, dict):
            continue
        suffix = f"@rank{index}" if len(ranks) > 1 else ""
        tensors.update({f"{name}{suffix}": value for name, value in named.items()
                        if isinstance(name, str) and isinstance(value, str)})
    return WeightsChecksum(checksum, per_gpu, tensors)


def _is_sha256(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def wire_dtype(name: Any, *, where: str) -> torch.dtype:
    if name not in WIRE_DTYPES:
        raise ProtocolError(f"{where}: dtype {name!r} is not one of {sorted(WIRE_DTYPES)}")
    import torch

    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
