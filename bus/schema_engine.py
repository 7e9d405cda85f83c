"""Generate calls between rollout workers: one worker's router asks another worker's engine for tokens.

Part of the wire schema; `bus.schema` re-exports every name here, and the rules of its docstring apply. The fields
are those of `engines.inference.base.GenerateRequest` and `GenerateOutput`, which the two ends convert from and to
(`actors/rollout/engine_calls.py`), so a call answered by another worker's engine returns exactly what the
caller's own engine would have: tokens, log-probs and the version of the weights that produced each token.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
import numpy as np

from bus.schema_base import Message, Record, _check_tensor, doc, tensor

_INT16 = (np.dtype("int16"),)


class EngineGenerate(Message):
    """Rollout worker -> another rollout worker (RPC, its "engine" endpoint): complete one prompt on your engine;
    reply EngineGenerated, or Error (reason "context_full": the prompt leaves no room in that engine's context;
    "bad_request": the engine refused the request, naming why; "engine_stopping": the worker is stopping, send the
    call to another engine; "weights_behind": the engine's weights are older than min_version)."""

    request_id: Annotated[str, doc("unique among the engine's requests in flight (the caller's worker id, group and "
                                   "a counter)")]
    input_ids: Annotated[list[int], doc("the prompt's token ids (a session's whole history so far)")]
    max_new_tokens: Annotated[int, doc("new tokens at most per sample")]
    temperature: Annotated[float, doc("sampling temperature (0: greedy)")] = 1.0
    top_p: Annotated[float, doc("top-p (1: off)")] = 1.0
    top_k: Annotated[int, doc("top-k (0: off)")] = 0
    stop: Annotated[list[str], doc("stop strings")] = msgspec.field(default_factory=list)
    stop_token_ids: Annotated[list[int], doc("token ids that end a sample")] = msgspec.field(default_factory=list)
    n: Annotated[int, doc("samples of the prompt")] = 1
    seed: Annotated[int | None, doc("the request's sampling seed (sample i draws from (seed, i)): the same draw on "
                                    "any engine at the same weights")] = None
    ignore_eos: Annotated[bool, doc("do not stop at the model's end-of-sequence tokens")] = False
    min_version: Annotated[int, doc("the oldest weights the caller may train on: an engine whose weights are older "
                                    "refuses the call at once (Error \"weights_behind\") instead of generating "
                                    "tokens the buffer would evict")] = 0
    adapter: Annotated[str | None, doc("the LoRA adapter, loaded on the answering engine under this name, that "
                                       "samples the request (none: the engine's own weights); an engine without it "
                                       "refuses the call (Error \"bad_request\")")] = None
    images: Annotated[list[bytes], doc("the prompt's images, encoded, in the order of their placeholders; `input_ids` "
                                       "hold each placeholder already expanded to the tokens its image takes")] = (
        msgspec.field(default_factory=list)
    )


class EngineOutput(Record):
    """One sample of an EngineGenerated: the fields of a GenerateOutput, token-aligned lists."""

    output_ids: Annotated[list[int], doc("the generated token ids")]
    log_probs: Annotated[list[float], doc("per generated token: its log-prob under the distribution it was sampled "
                                          "from")]
    versions: Annotated[list[int], doc("per generated token: the policy version of the weights that produced it (the "
                                       "answering engine's)")]
    finish_reason: Annotated[Literal["stop", "length", "abort"], doc("why the sample ended")]
    sample_index: Annotated[int, doc("its place among the request's n samples")] = 0
    prompt_len: Annotated[int, doc("tokens of the request's prompt")] = 0
    matched_stop: Annotated[str | int | None, doc("the stop string or token id that ended it")] = None
    routed_experts: Annotated[np.ndarray | None, tensor("int16", "MoE routing replay: the experts of each token, "
                                                        "flattened row-major to routed_experts_shape")] = None
    routed_experts_shape: Annotated[list[int], doc("[tokens, layers, top_k] of routed_experts")] = msgspec.field(
        default_factory=list)
    cached_tokens: Annotated[int, doc("prompt tokens whose keys and values came from the engine's prefix cache")] = 0
    stale_cached_tokens: Annotated[int, doc("prompt tokens the cache held from older weights, prefilled again")] = 0
    reprefilled_tokens: Annotated[int, doc("tokens prefilled again because a weight update dropped them "
                                           "mid-generation")] = 0

    def __post_init__(self) -> None:
        self.routed_experts = _check_tensor("EngineOutput", "routed_experts", self.routed_experts, _INT16, None)


class EngineGenerated(Message):
    """Rollout worker -> the caller (RPC reply to EngineGenerate): the samples, and what the caller's router weighs
    this engine by next time."""

    request_id: Annotated[str, doc("the request answered")]
    outputs: Annotated[list[EngineOutput], doc("n samples, ordered by sample_index")]
    engine_version: Annotated[int, doc("the policy version of the weights the engine served when it answered")] = 0
    load: Annotated[int, doc("sequences the engine had in flight for other callers when it answered (its own "
                             "worker's included): the load the caller does not see itself")] = 0
    stopping: Annotated[bool, doc("the answering worker is stopping: its engine's abort may have cut the outputs "
                                  "short (finish \"abort\"); the caller generates them again elsewhere")] = False


class EngineAbort(Message):
    """Rollout worker -> the worker whose engine runs one of its calls (RPC, "engine" endpoint): finish that request
    now (its caller gave up on it); reply Ack. An unknown or finished request id is ignored."""

    request_id: Annotated[str, doc("the request to abort")]
