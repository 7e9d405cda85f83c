"""The inference-engine interface every rollout worker talks to, and the types that cross it.

Two engines implement it: the embedded torch engine (`torch_engine.py`, the CPU default and the reference)
and the SGLang client. The rollout worker holds one `InferenceEngine` and never knows which, so everything
here is phrased in token ids (no text), per-token log-probs and per-token policy versions.

Conventions shared by all implementations:

* **Log-probs** are those of the sampled token under the distribution the engine actually sampled from.
  With `top_p=1` and `top_k=0` (the RL default) that is exactly `log_softmax(logits / temperature)`, which is
  what the trainer recomputes, so the behaviour/learner ratio is 1 up to numerics at version parity. With
  top-p/top-k active it is the log-prob under the renormalized truncated distribution; the trainer sees the
  full vocabulary and cannot reproduce the truncation (the same limitation as in every other framework), so
  importance ratios then carry that mismatch too. Greedy decoding (`temperature=0`) reports
  `log_softmax(logits)`, i.e. temperature 1 for the log-prob, and ignores top-p/top-k.
* **Versions**: every generated token carries the policy version of the weights that produced it. A weight
  update lands between two decode steps, so one output may mix versions; a sample's staleness is the largest
  distance between the learner's version and any of its tokens' (`policies.staleness.token_staleness`).
* **Resuming**: an aborted or paused-with-abort request returns its partial output with
  `finish_reason="abort"`. It is resumed by a *new* request whose `input_ids` are the prompt plus the partial
  output (see `continuation_request`); the partial tokens keep their original log-probs and versions and
  the caller concatenates. A resumed seeded sample does not replay the random stream it would have used.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:  # a rollout worker process imports this module and must not pay for torch unless its engine does
    import torch

    from engines.weights.fingerprint import FingerprintPlan, ServedPrints
    from engines.weights.manifest import TensorSpec

FinishReason = Literal["stop", "length", "abort"]
PauseMode = Literal["abort", "keep"]
PAUSE_MODES: tuple[str, ...] = ("abort", "keep")


def check_pause_mode(mode: str) -> None:
    """Refuse a mode `pause` does not know before anything is paused; every engine calls this first."""
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")


DEFAULT_MAX_NEW_TOKENS = 1024


class ContextFull(ValueError):
    """A request whose prompt leaves no room for a new token in the engine's context. A multi-turn episode that
    grew this long ends with the turns it has; a single-turn prompt this long fails its samples. Neither is
    retried: the same prompt would not fit on any engine of the run."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request; validated on construction so a bad value never reaches an engine.

    `top_k=0` and `top_p=1.0` mean "off". `temperature=0` means greedy. `n` samples share the prompt (the
    torch engine prefills it once). A `seed` makes a request's samples reproducible on the same engine and
    weights: sample `i` of a request draws from its own generator derived from `(seed, i)`, independent of
    what else is in the batch. `stop` strings and `stop_token_ids` end a sample with `finish_reason="stop"`;
    the tokens that completed the match stay in the output (token-level RL needs every sampled token).
    End-of-sequence tokens of the model stop a sample too unless `ignore_eos`. `min_new_tokens`: the stop and
    end-of-sequence token ids cannot be sampled before that many tokens (SGLang's and HF's meaning; a stop string
    still ends a sample).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    seed: int | None = None
    ignore_eos: bool = False
    min_new_tokens: int = 0

    def __post_init__(self) -> None:
        # Lists are accepted for convenience (they arrive from msgpack/JSON) and frozen into tuples.
        if isinstance(self.stop, str):
            raise ValueError(f"SamplingParams.stop must be a tuple of strings, got the single string {self.stop!r}")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check(
            isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0,
            "temperature",
            f"must be a finite number >= 0 (0 = greedy), got {self.temperature!r}",
        )
        _check(
            isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1,
            "top_p",
            f"must be in (0, 1], got {self.top_p!r}",
        )
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k", f"must be an int >= 0 (0 = off), got {self.top_k!r}")
        _check(
            _is_int(self.max_new_tokens) and self.max_new_tokens >= 1,
            "max_new_tokens",
            f"must be an int >= 1, got {self.max_new_tokens!r}",
        )
        _check(
            _is_int(self.min_new_tokens) and 0 <= self.min_new_tokens <= self.max_new_tokens,
            "min_new_tokens",
            f"must be an int in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens!r}",
        )
        _check(_is_int(self.n) and self.n >= 1, "n", f"must be an int >= 1, got {self.n!r}")
        _check(self.seed is None or _is_int(self.seed), "seed", f"must be an int or None, got {self.seed!r}")
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", f"must be a bool, got {self.ignore_eos!r}")
        for stop in self.stop:
            _check(isinstance(stop, str) and stop != "", "stop", f"entries must be non-empty strings, got {stop!r}")
        for token_id in self.stop_token_ids:
            _check(
                _is_int(token_id) and token_id >= 0,
                "stop_token_ids",
                f"entries must be ints >= 0, got {token_id!r}",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class GenerateRequest:
    """One prompt to complete. `request_id` must be unique among the engine's requests in flight.

    `routing_key` says which calls belong together (an agent episode's session): a router across engines sends them
    to the same engine where it can, so each turn finds the keys and values of the turns before it. Engines ignore
    it; a router given none uses its own default (the group's id: `actors/rollout/router.py`).

    `adapter` names the LoRA adapter, loaded on the engine under that name, whose policy samples the request (None:
    the engine's own weights); requests of different adapters decode in one batch (`multi_lora.py`).

    `images` (vision-language models): the prompt's images, encoded, in the order of their placeholders; `input_ids`
    hold each placeholder already expanded to the tokens its image takes (`engines/vision/processor.py`)."""

    request_id: str
    input_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    routing_key: str | None = None
    adapter: str | None = None
    images: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"GenerateRequest.request_id must be a non-empty string, got {self.request_id!r}")
        if not self.input_ids:
            raise ValueError(f"request {self.request_id!r}: input_ids is empty")
        if not all(_is_int(token) and token >= 0 for token in self.input_ids):
            bad = next(token for token in self.input_ids if not (_is_int(token) and token >= 0))
            raise ValueError(f"request {self.request_id!r}: input_ids holds {bad!r}, expected ints >= 0")
        if not isinstance(self.params, SamplingParams):
            raise ValueError(f"request {self.request_id!r}: params must be SamplingParams, got {type(self.params)}")
        if self.routing_key is not None and (not isinstance(self.routing_key, str) or not self.routing_key):
            raise ValueError(f"request {self.request_id!r}: routing_key must be a non-empty string or None, got "
                             f"{self.routing_key!r}")
        if self.adapter is not None and (not isinstance(self.adapter, str) or not self.adapter):
            raise ValueError(f"request {self.request_id!r}: adapter must be a non-empty string or None, got "
                             f"{self.adapter!r}")
        if not isinstance(self.images, tuple) or not all(isinstance(image, bytes) for image in self.images):
            raise ValueError(f"request {self.request_id!r}: images must be a tuple of encoded bytes, got "
                             f"{type(self.images).__name__}")


@dataclass(frozen=True)
class RoutedExperts:
    """Per token and MoE layer, the experts a forward routed the token to: int16 [tokens, layers, top_k],
    row-major, little-endian. Token t is the t-th of prompt + output; the last output token is never fed to the
    model, so `tokens` is one less than their count (slime's and SGLang's layout)."""

    data: bytes
    shape: tuple[int, int, int]

    @classmethod
    def of(cls, table: np.ndarray) -> RoutedExperts:
        """From an integer array [tokens, layers, top_k] of any width."""
        return cls(np.ascontiguousarray(table, dtype="<i2").tobytes(), tuple(table.shape))  # type: ignore[arg-type]

    def table(self) -> np.ndarray:
        """The routes as int16 [tokens, layers, top_k] (a read-only view of the bytes)."""
        return np.frombuffer(self.data, dtype="<i2").reshape(self.shape)


@dataclass(frozen=True)
class GenerateOutput:
    """One finished (or aborted) sample. `output_ids`, `log_probs` and `versions` are aligned per token.

    `matched_stop` is the stop string or token id that ended the sample (None for length/abort).
    `prompt_len` is the length of the request's input_ids, so a consumer can split prompt and response
    without holding the request.
    """

    request_id: str
    output_ids: list[int]
    log_probs: list[float]
    versions: list[int]
    finish_reason: FinishReason
    sample_index: int = 0
    prompt_len: int = 0
    matched_stop: str | int | None = None
    routed_experts: RoutedExperts | None = None  # engines that record routes (`record_routes`)
    # Engines with a prefix cache: input tokens whose keys and values came from it (what OpenAI's usage calls
    # `cached_tokens`); tokens it held from older weights, prefilled again; tokens prefilled again because a weight
    # update dropped the sample's keys and values mid-generation.
    cached_tokens: int = 0
    stale_cached_tokens: int = 0
    reprefilled_tokens: int = 0


def continuation_request(
    request: GenerateRequest, partial: GenerateOutput, request_id: str | None = None
) -> GenerateRequest:
    """The request that resumes one aborted sample: prompt + partial output in, the remaining budget out.

    It always asks for one sample (the partial output is one sample of the original request). The caller
    keeps `partial` and concatenates: `partial.output_ids + resumed.output_ids`, likewise log-probs and
    versions. Raises if nothing is left to generate, since a zero-token request is not a request.
    """
    remaining = request.params.max_new_tokens - len(partial.output_ids)
    if remaining < 1:
        raise ValueError(
            f"request {request.request_id!r} sample {partial.sample_index}: nothing left to resume "
            f"({len(partial.output_ids)} of max_new_tokens={request.params.max_new_tokens} already generated)"
        )
    seed = request.params.seed
    params = replace(
        request.params,
        n=1,
        max_new_tokens=remaining,
        seed=None if seed is None else derive_sample_seed(seed, partial.sample_index + len(partial.output_ids)),
    )
    return GenerateRequest(
        request_id=request_id or f"{request.request_id}/resume{partial.sample_index}-{len(partial.output_ids)}",
        input_ids=list(request.input_ids) + list(partial.output_ids),
        params=params,
        routing_key=request.routing_key,
        adapter=request.adapter,
        images=request.images,
    )


def derive_sample_seed(seed: int, sample_index: int) -> int:
    """Seed of sample `i` of a seeded request: a splitmix64 mix, so nearby (seed, i) pairs do not collide."""
    mask = (1 << 64) - 1
    z = (seed * 0x9E3779B97F4A7C15 + sample_index + 0x632BE59BD9B4E019) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass(frozen=True)
class KvCacheAccount:
    """How an engine's KV cache met the weight updates so far: the integrity certificate's `caches` check.

    A token sampled over keys and values an older weight version computed is off-policy in a way no version tag
    shows: the sample says version v, the trainer recomputes it all at v, and the importance ratio is
    computed against log-probs that v alone did not produce."""

    recomputes_on_update: bool  # the engine's promise: every token from keys/values of its own version
    stale_kv_tokens: int  # tokens sampled over keys/values an older version computed


@dataclass(frozen=True)
class PrefixCacheStats:
    """What an engine's prefix cache saved so far (cumulative per engine process), per distinct sequence prefilled.

    `hit_rate` is the share of prefilled sequences' tokens whose keys and values came from the cache rather than a
    forward. `stale_tokens` were held from older weights and prefilled again (a conversation that spans a weight
    update); `reprefilled_tokens` were in flight when an update dropped them (counted with the cache off too)."""

    lookups: int
    hits: int
    reused_tokens: int
    prefilled_tokens: int
    stale_tokens: int
    reprefilled_tokens: int
    evicted_tokens: int
    held_tokens: int
    capacity_tokens: int

    @property
    def hit_rate(self) -> float:
        total = self.reused_tokens + self.prefilled_tokens
        return self.reused_tokens / total if total else 0.0

    def metrics(self, prefix: str = "engine.prefix_cache.") -> dict[str, float]:
        """Flat float counters, as the rollout worker's heartbeat carries them."""
        fields = {name: float(getattr(self, name)) for name in self.__dataclass_fields__}
        return {f"{prefix}{name}": value for name, value in {**fields, "hit_rate": self.hit_rate}.items()}


class InferenceEngine(ABC):
    """What a rollout worker needs from an inference engine; all methods are safe to call from one event loop.

    Implementations apply weight updates, pauses and aborts at decode-step boundaries, so an in-flight
    request is never torn mid-step; `generate` may be awaited concurrently by many tasks and is where
    batching happens.
    """

    @abstractmethod
    async def generate(self, request: GenerateRequest) -> list[GenerateOutput]:
        """Complete `request`; returns `request.params.n` outputs ordered by `sample_index`.

        Cancelling the awaiting task aborts the request inside the engine (its slot is freed).
        """

    @abstractmethod
    async def abort(self, request_id: str | None = None) -> None:
        """Finish one request (or all, with None) now: its awaiters get partial outputs marked "abort".

        Unknown or already finished ids are ignored: an abort may race a completion.
        """

    @abstractmethod
    async def pause(self, mode: PauseMode = "keep") -> None:
        """Stop decoding at the next step boundary; returns once no further step will run until `resume`.

        "keep": in-flight requests hold their state and continue after `resume`. "abort": in-flight requests
        return their partial outputs with finish_reason "abort". Requests arriving while paused wait.
        """

    @abstractmethod
    async def resume(self) -> None:
        """Undo `pause`; a no-op when not paused."""

    @abstractmethod
    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy the given tensors (HF state-dict names; any subset) into the live weights, then set `version`.

        Applied atomically between two decode steps: tokens sampled after it carry `version`. A caller that
        streams one version in several buckets pauses ("keep") first and resumes after the last bucket, so
        no token is produced by a half-updated model.
        """

    @property
    @abstractmethod
    def version(self) -> int:
        """The policy version of the weights the next decode step uses."""

    async def served_fingerprints(
        self, specs: tuple[TensorSpec, ...], plan: FingerprintPlan
    ) -> ServedPrints | None:
        """Fingerprints of what the engine serves now for each pushed tensor, as `plan` says (`plan.prints()`;
        `engines.weights.fingerprint`), so the learner can check a push landed as sent. None: this engine cannot
        tell, and the check says so. A push's loader asks once the weights are loaded and generation has resumed,
        so generation does not wait for the check: the engine must keep its weights from being written meanwhile."""
        return None

    def delta_target(self, name: str) -> torch.Tensor | None:
        """The live tensor a delta push may write the changed elements of `name` into, in place, while the engine is
        paused for the push (`engines.weights.held`): one that holds exactly what was pushed, in the pushed dtype or
        a wider float. None: the push's receiver keeps a copy of `name` and loads it whole through
        `update_weights`, which every engine can do."""
        return None

    def kv_cache_account(self) -> KvCacheAccount | None:
        """Whether any token was sampled over a KV cache older than its weights. None: this engine cannot tell
        (its cache is not ours to see), and the certificate says the check did not run for it."""
        return None

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """What the engine's prefix cache reused and prefilled so far; None: it keeps none across requests, or cannot
        tell."""
        return None

    def cached_prefix_tokens(self, input_ids: list[int], adapter: str | None = None) -> int | None:
        """How many leading tokens of `input_ids` the engine holds keys and values for at the weights it serves now
        (with LoRA adapter `adapter`'s, when named): what a router with session affinity weighs engines by. None: it
        cannot tell."""
        return None

    async def on_idle(self) -> None:  # noqa: B027 - most engines have nothing to hand over
        """The worker has nothing to generate for now. An engine that shares its device with the learner (a
        colocated run) may hand memory over until its next request or weight update needs it back."""

    memory_releases: int = 0  # times `on_idle` handed memory over (an engine that does counts them)

    @abstractmethod
    async def health(self) -> dict[str, object]:
        """A small JSON-able status dict; `healthy` is False once the engine cannot serve requests."""

    @abstractmethod
    async def close(self) -> None:
        """Abort everything in flight and release resources; later calls to `generate` raise."""

    async def __aenter__(self) -> InferenceEngine:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{field_name} {message}")
