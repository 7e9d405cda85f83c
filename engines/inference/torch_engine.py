"""The embedded torch inference engine: a Hugging Face causal LM behind the `InferenceEngine` interface.

The default on machines without CUDA and the reference the SGLang engine is checked against, it favours exactness
(greedy output equals `model.generate()`, log-probs equal the trainer's), then speed (`batcher.py`).

Threading: one decode thread per engine runs every forward; torch releases the GIL inside its kernels, so the
owning actor's asyncio loop keeps answering while the model computes. The async methods put a command on a queue
and await a future the decode thread resolves (`loop.call_soon_threadsafe`); the thread applies commands (requests,
aborts, pause/resume, weight updates, close) between two steps, so a weight update lands between two decode steps
exactly. The decode thread inherits the caller's `torch.set_num_threads`.

Weight updates and the KV cache: by default (`recompute_kv_on_update=True`) an update also drops the KV
cache, and the in-flight samples are re-prefilled with the new weights before their next token, so every
token tagged with version v was computed entirely by version-v weights, exactly what the trainer
recomputes. With False the cache computed by older weights is kept (cheaper, slightly off-policy keys and
values), as SGLang does when it updates weights without flushing its cache.

Across requests, a prefix cache (`prefix_cache.py`, `prefix_cache_bytes`) keeps what every prefill computed and what
every finished sample decoded, so the next turn of a conversation or another sample of a prompt prefills only what
is new. It is version-correct by construction: every run of keys and values is stamped with the weights it was
computed under and is reused under those weights only (with `recompute_kv_on_update`), and a sample that took any
from it carries their oldest version into the same account (`kv_cache_account`) as its own cache row.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import queue
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from engines.inference import base
from engines.inference.batch_invariant import make_batch_invariant
from engines.inference.batcher import BatchLimits, ContinuousBatcher, StepRecord
from engines.inference.decoding_sequence import DecodingSequence
from engines.inference.engine_commands import DEFERRED, Command, Pending, Reply
from engines.inference.fp8_linear import serve_fp8
from engines.inference.model_facts import check_supported, context_length, eos_token_ids, load_model_folder
from engines.inference.prefix_cache import PrefixCache
from engines.inference.scoring import score_tokens
from engines.inference.served_weights import ServedWeights
from engines.inference.static_batcher import StaticBatcher
from engines.inference.vision_rows import placeholder_tokens, prompt_vision
from engines.vision.images import DEFAULT_LIMITS, ImageLimits
from engines.vision.processor import VisionProcessor
from engines.weights.fingerprint import FingerprintPlan, ServedPrints
from engines.weights.manifest import TensorSpec

logger = logging.getLogger(__name__)

StepListener = Callable[[StepRecord], None]
DEFAULT_PREFIX_CACHE_BYTES = 1 << 30


class TorchEngine(base.InferenceEngine):
    """Batched generation with a KV cache and continuous batching on one HF model, driven by one thread.

    `step_listener`, if given, is called on the decode thread after every step with a `StepRecord` (which
    rows decoded, joined and left): use it for tracing and metrics; it must be quick, and what it raises is
    logged and ignored.

    `deterministic` makes a sequence's tokens and log-probs independent of the other rows of its batch
    (`batch_invariant.py`: `--deterministic-inference`), at about 0.4x the decode speed of the stock kernels.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: PreTrainedTokenizerBase | None,
        *,
        max_batch_size: int = 64,
        max_batch_tokens: int = 131_072,
        max_prefill_tokens: int = 16_384,
        prefill_chunk_tokens: int = 8_192,
        max_model_len: int | None = None,
        version: int = 0,
        seed: int | None = None,
        recompute_kv_on_update: bool = True,
        step_listener: StepListener | None = None,
        lora_scaling: float | None = None,
        release_memory_when_idle: bool = False,
        deterministic: bool = False,
        kv_cache: str = "dynamic",
        kv_pool_columns: int | None = None,
        cuda_graphs: bool = True,
        record_routes: bool = False,
        prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES,
        max_adapters: int = 8,
        adapters: tuple[str, ...] = (),
        vision: VisionProcessor | None = None,
    ) -> None:
        """`prefill_chunk_tokens`: the most input tokens (rows x columns) one prefill forward runs; a longer prefill
        runs a chunk per step between the running rows' decode steps (`batcher.py`), so its activations stay bounded
        and running rows keep decoding. `kv_cache`: "dynamic" (caches sized to the rows, the CPU's choice and the
        reference) or "static" (a pool allocated once, `kv_pool_columns` per row, default max_batch_tokens /
        max_batch_size, with each decode step replayed from a CUDA graph when `cuda_graphs` and the model is on a GPU:
        static_batcher.py).
        `record_routes`: an MoE model's outputs carry each token's experts (`GenerateOutput.routed_experts`), for
        rollout routing replay; the dynamic layout only. `prefix_cache_bytes`: the memory the prefix cache across
        requests may take on the model's device (0: no prefix cache). `max_adapters`: how many named LoRA adapters
        it serves at once beside its weights (`update_weights(..., adapter=name)`, `GenerateRequest.adapter`).
        `adapters`: the named adapters it serves from the start (a run of several policies: one per policy), each fresh
        until its first load: a fresh LoRA adapter (B = 0) computes exactly what the base weights do, so its requests
        run on them, at the adapter's version 0, with no factors to send before the learners' first push.
        `vision`: a vision-language model's image side (`from_pretrained` finds it); requests may then carry images,
        on the dynamic layout without deterministic inference (`vision_rows.py`)."""
        check_supported(model)
        if vision is not None and (kv_cache == "static" or deterministic):
            raise ValueError("images (a vision-language model) need kv_cache='dynamic' and no deterministic inference")
        if kv_cache not in ("dynamic", "static"):
            raise ValueError(f"kv_cache must be 'dynamic' or 'static', got {kv_cache!r}")
        if kv_cache == "static" and deterministic:
            raise ValueError("kv_cache='static' cannot run deterministic (batch-invariant) inference; use 'dynamic'")
        if kv_cache == "static" and record_routes:
            raise ValueError("kv_cache='static' does not record routed experts yet; use 'dynamic'")
        if not isinstance(prefix_cache_bytes, int) or prefix_cache_bytes < 0:
            raise ValueError(f"prefix_cache_bytes must be an int >= 0 (0: no prefix cache), got "
                             f"{prefix_cache_bytes!r}")
        if adapters and (kv_cache == "static" or deterministic):
            raise ValueError(f"adapters {list(adapters)}: named adapters need kv_cache='dynamic' and no deterministic "
                             "inference")
        if deterministic:  # a sequence's logits stop depending on the batch around it (batch_invariant.py)
            make_batch_invariant(model)
        self._model = model.eval()
        self._tokenizer = tokenizer
        self._limits = BatchLimits(max_batch_size, max_batch_tokens, max_prefill_tokens, prefill_chunk_tokens)
        self._max_model_len = max_model_len or context_length(getattr(model, "config", None)) or 1 << 30
        self._vision = vision
        self._vocab_size = model.get_input_embeddings().num_embeddings
        self._eos_token_ids = eos_token_ids(model, tokenizer)
        self._weights = ServedWeights(model, lora_scaling=lora_scaling, max_adapters=max_adapters,
                                      fresh_adapters=adapters)
        self._release_when_idle = release_memory_when_idle
        self._recompute_kv_on_update = recompute_kv_on_update
        self._step_listener = step_listener
        rng = torch.Generator()
        if seed is None:
            rng.seed()
        else:
            rng.manual_seed(seed)
        prefix_cache = (PrefixCache(prefix_cache_bytes, same_weights_only=recompute_kv_on_update)
                        if prefix_cache_bytes else None)
        self._batcher: ContinuousBatcher
        if kv_cache == "static":
            columns = min(self._max_model_len, kv_pool_columns or max_batch_tokens // max_batch_size)
            self._batcher = StaticBatcher(model, tokenizer, self._limits, rng, columns=columns,
                                          use_graphs=cuda_graphs, prefix_cache=prefix_cache)
        else:
            self._batcher = ContinuousBatcher(model, tokenizer, self._limits, rng, batch_invariant=deterministic,
                                              record_routes=record_routes, prefix_cache=prefix_cache)
            self._batcher.adapters = self._weights.named_adapters
            if vision is not None:
                self._batcher.held_back_tokens = torch.tensor(placeholder_tokens(model), device=self._batcher.device)

        # Written by the decode thread only; read anywhere (single attribute reads are atomic).
        self._version = version
        self._paused = False
        self._closed = False
        self._generated_tokens = 0
        self.memory_releases = 0  # times the engine gave its cached memory back between turns (colocated runs)
        self._last_error: str | None = None
        self._pending: dict[str, Pending] = {}

        self._closing = False  # set by close() on the caller's side, so no command is queued after it
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="torch-engine-decode", daemon=True)
        self._thread.start()

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu", image_limits: ImageLimits = DEFAULT_LIMITS,
                        fp8: bool | str = False, **options: Any) -> TorchEngine:
        """Load a local HF causal-LM folder (weights + tokenizer) and start the engine's decode thread.

        `options` are the constructor's keyword arguments (batch limits, `version`, `seed`, ...), passed on as they
        are: one list of options and defaults, the constructor's. One it does not take fails before the load.
        `fp8`: serve the decoder's projections in FP8 (`fp8_linear.py`): True, or a kernel's name (`fp8_matmul`)."""
        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path}: no config.json; expected a local Hugging Face model folder")
        inspect.signature(cls).bind(None, None, **options)
        model, tokenizer, vision = load_model_folder(path, dtype=dtype, device=device, image_limits=image_limits)
        if fp8:
            serve_fp8(model, kernel="auto" if fp8 is True else fp8)
        return cls(model, tokenizer, vision=vision, **options)

    @property
    def version(self) -> int:
        """The base weights' version: what the tokens of a request naming no adapter carry."""
        return self._version

    def adapter_version(self, adapter: str) -> int:
        """The policy version of named adapter `adapter`, what its requests' tokens carry: 0 before its first load,
        as a fresh engine's `version` (a fresh adapter is its policy's version 0, the base weights exactly)."""
        return self._batcher.adapter_versions.get(adapter, 0)

    @property
    def model(self) -> nn.Module:
        return self._model

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase | None:
        return self._tokenizer

    async def generate(self, request: base.GenerateRequest) -> list[base.GenerateOutput]:
        # decoding and resizing a prompt's images is CPU work the caller's event loop (heartbeats) must not wait on
        samples = await asyncio.to_thread(self._samples_for, request) if request.images else self._samples_for(request)
        try:
            return await self._call(_Submit(request, samples))
        except asyncio.CancelledError:
            if not self._closing:
                self._commands.put(_Abort(frozenset([request.request_id])))
            raise

    async def abort(self, request_id: str | None = None) -> None:
        await self._call(_Abort(None if request_id is None else frozenset([request_id])))

    async def pause(self, mode: base.PauseMode = "keep") -> None:
        base.check_pause_mode(mode)
        await self._call(_Pause(mode))

    async def resume(self) -> None:
        await self._call(_Resume())

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, *,
                             adapter: str | None = None) -> None:
        """With `adapter`: LoRA factors of that named adapter, loaded unmerged beside the weights, the other adapters
        untouched (`multi_lora.py`). Without: LoRA factors merge into the weights (`lora_merge.py`)."""
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ValueError(f"update_weights: version must be an int >= 0, got {version!r}")
        if adapter is not None and (not isinstance(adapter, str) or not adapter):
            raise ValueError(f"update_weights: adapter must be a non-empty string or None, got {adapter!r}")
        await self._call(_UpdateWeights(named_tensors, version, adapter))

    def serve_adapter(self, adapter: str) -> None:
        """One more named adapter, fresh until its first load (a policy that joined the running job)."""
        self._weights.serve_fresh(adapter)

    async def unload_adapter(self, adapter: str) -> None:
        """Stop serving a named adapter, loaded or fresh, the others untouched; refused while requests use it."""
        await self._call(_UnloadAdapter(adapter))

    async def served_fingerprints(self, specs: tuple[TensorSpec, ...], plan: FingerprintPlan, *,
                                  adapter: str | None = None) -> ServedPrints:
        """Its weight for a full tensor; for a LoRA factor, the factor merged into its layer, and only if the layer
        holds that merge (an adapter received but never merged fingerprints as absent); with `adapter`, the factor
        of that named adapter, only if its slot holds it. Computed on a thread of its own while the decode thread
        keeps generating; no load can change the weights meanwhile (`served_weights.py`)."""
        if self._closing or not self._thread.is_alive():
            raise RuntimeError("torch engine is closed")
        return await asyncio.to_thread(self._weights.fingerprints, specs, plan, adapter)

    def delta_target(self, name: str) -> torch.Tensor | None:
        return self._weights.delta_target(name)

    async def score(self, input_ids: list[int], *, start: int, temperature: float = 1.0) -> list[float]:
        """log p(input_ids[i] | input_ids[:i]) for i in [start, len): this engine as a scorer of given tokens (a
        distillation teacher), at `temperature` (0 scores at 1, as greedy rollouts report). One forward between
        decode steps, over the weights served now; nothing is cached."""
        if not 1 <= start < len(input_ids) or len(input_ids) > self._max_model_len:
            raise ValueError(f"score: start {start} must be in [1, {len(input_ids) - 1}] and the {len(input_ids)} "
                             f"tokens within the model's context of {self._max_model_len}")
        if max(input_ids) >= self._vocab_size or min(input_ids) < 0:
            raise ValueError(f"score: input_ids must be in [0, {self._vocab_size}), got {min(input_ids)}.."
                             f"{max(input_ids)}")
        return await self._call(_Score(list(input_ids), start, temperature or 1.0))

    def kv_cache_account(self) -> base.KvCacheAccount:
        return base.KvCacheAccount(self._recompute_kv_on_update, self._batcher.stale_kv_tokens)

    def prefix_cache_stats(self) -> base.PrefixCacheStats | None:
        return self._batcher.prefix_cache_stats()

    def cached_prefix_tokens(self, input_ids: list[int], adapter: str | None = None) -> int | None:
        """Exact as of the last step boundary (the tree is read under its lock, from any thread)."""
        cache = self._batcher.prefix_cache
        return 0 if cache is None else cache.holds(list(input_ids), self._batcher.epoch_of(adapter), adapter)

    def weights_snapshot(self) -> list[tuple[str, torch.Tensor]]:
        """A copy of every weight by name: what an SGLang server that backs released weights up to the CPU keeps
        (our compatible server's stand-in for `--enable-weights-cpu-backup`). Call it while nothing generates."""
        return [(name, tensor.detach().clone()) for name, tensor in self._weights.parameters.items()]

    async def health(self) -> dict[str, object]:
        return {
            "engine": "torch",
            "healthy": self._thread.is_alive() and not self._closing,
            "version": self._version,
            "adapter_versions": dict(self._batcher.adapter_versions),
            "paused": self._paused,
            "running": len(self._batcher.running),
            "prefilling": len(self._batcher.prefilling.samples) if self._batcher.prefilling else 0,
            "waiting": len(self._batcher.waiting),
            "requests": len(self._pending),
            "steps": self._batcher.steps,
            "generated_tokens": self._generated_tokens,
            "memory_releases": self.memory_releases,
            "stale_kv_tokens": self._batcher.stale_kv_tokens,
            "prefix_cache": None if (stats := self.prefix_cache_stats()) is None else {
                "hit_rate": stats.hit_rate, "reused_tokens": stats.reused_tokens,
                "prefilled_tokens": stats.prefilled_tokens, "held_tokens": stats.held_tokens},
            "last_error": self._last_error,
        }

    async def close(self) -> None:
        if self._closing:
            return
        if not self._thread.is_alive():
            self._closing = True
            return
        await self._call(_Close())
        self._closing = True
        await asyncio.to_thread(self._thread.join)

    # ----- caller side -----------------------------------------------------------------------------------

    async def _call(self, command: Command) -> Any:
        if self._closing or not self._thread.is_alive():
            raise RuntimeError("torch engine is closed")
        loop = asyncio.get_running_loop()
        command.reply = Reply(loop, loop.create_future())
        self._commands.put(command)
        return await command.reply.future

    def _samples_for(self, request: base.GenerateRequest) -> list[DecodingSequence]:
        """Validate a request against this model and build its samples; raises here, in the caller."""
        rid, params, prompt = request.request_id, request.params, request.input_ids
        if max(prompt) >= self._vocab_size:
            raise ValueError(f"request {rid!r}: input_ids holds {max(prompt)}, the vocabulary has {self._vocab_size}")
        if len(prompt) >= self._max_model_len:
            raise base.ContextFull(
                f"request {rid!r}: prompt of {len(prompt)} tokens leaves no room in the model's context of "
                f"{self._max_model_len} tokens"
            )
        if params.stop and self._tokenizer is None:
            raise ValueError(f"request {rid!r}: stop strings need a tokenizer; this engine was built without one")
        if request.adapter is not None:
            self._check_adapter(rid, request.adapter)
        vision = prompt_vision(self._vision, self._model, rid, prompt, request.images)
        max_new_tokens = min(params.max_new_tokens, self._max_model_len - len(prompt))
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self._eos_token_ids)
        samples = [
            DecodingSequence(
                request_id=rid,
                sample_index=index,
                prompt_ids=list(prompt),
                params=params,
                max_new_tokens=max_new_tokens,
                stop_token_ids=stop_ids,
                seed=None if params.seed is None else base.derive_sample_seed(params.seed, index),
                adapter=request.adapter,
                vision=vision,
            )
            for index in range(params.n)
        ]
        for sample in samples:
            if sample.seed is not None:
                sample.generator = torch.Generator().manual_seed(sample.seed)
        if (refusal := self._batcher.admissible(samples[0])) is not None:
            raise ValueError(f"request {rid!r}: {refusal}")
        return samples

    def _unload_adapter(self, adapter: str) -> None:
        users = sorted({sample.request_id for sample in self._batcher.in_flight() if sample.adapter == adapter})
        self._weights.unload_adapter(adapter, users)
        self._batcher.adapter_unloaded(adapter)

    def _check_adapter(self, request_id: str, adapter: str) -> None:
        if self._batcher.adapters is None:
            raise ValueError(f"request {request_id!r}: adapter {adapter!r}: kv_cache='static' does not serve named "
                             "adapters yet; use kv_cache='dynamic'")
        if self._batcher.batch_invariant:
            raise ValueError(f"request {request_id!r}: adapter {adapter!r}: deterministic inference does not cover "
                             "named adapters yet")
        if not self._weights.serves(adapter):
            raise ValueError(f"request {request_id!r}: adapter {adapter!r} is not loaded on this engine (loaded: "
                             f"{sorted(self._weights.named_adapters.names)})")

    # ----- decode thread -----------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                busy = False
                while not self._closed:
                    idle = self._paused or not self._batcher.has_work()
                    # a turn's end: no work left; a pause that keeps its rows (a weight load) is none, their KV stays
                    if busy and not self._batcher.has_work() and self._release_when_idle:
                        self._release_memory()
                    busy = not idle
                    self._apply_commands(block=idle)
                    if not self._closed and not self._paused and self._batcher.has_work():
                        self._step()
        except BaseException as exc:  # a bug here must not leave awaiters hanging on a dead thread
            logger.exception("torch engine decode thread died")
            self._last_error = repr(exc)
            self._fail_pending(RuntimeError(f"torch engine decode thread died: {exc!r}"))
        finally:
            self._refuse_leftover_commands()

    def _apply_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(block=block)
        except queue.Empty:
            return
        while True:
            self._apply(command)
            if self._closed:
                return
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: Command) -> None:
        try:
            result = command.apply(self)
        except Exception as exc:  # a bad command fails its caller, never the engine
            command.fail(exc)
        else:
            command.succeed(result)

    def _step(self) -> None:
        try:
            result = self._batcher.step(self._version)
        except Exception as exc:
            logger.exception("torch engine step failed; failing every request in flight")
            self._last_error = repr(exc)
            self._batcher.reset()
            self._fail_pending(RuntimeError(f"torch engine step failed: {exc!r}"))
            return
        self._generated_tokens += result.new_tokens
        for request_id in {sample.request_id for sample in result.finished}:
            self._resolve_if_done(request_id)
        if self._step_listener is not None:
            try:
                self._step_listener(result.record)
            except Exception:
                logger.exception("torch engine step listener raised; ignored")

    def _release_memory(self) -> None:
        """Between two turns of a colocated run: the learner trains next on the same device. The finished
        sequences' KV cache is already freed, but its blocks stay in this process's caching allocator; they go
        back to the device, where the learner's process can allocate them."""
        if isinstance(self._batcher, StaticBatcher):
            self._batcher.release_memory()
        if self._batcher.device.type == "cuda":
            self._batcher.release_prefix_cache()  # the learner wants the device; the next update would void it
            torch.cuda.empty_cache()
        self.memory_releases += 1

    def _fail_pending(self, failure: Exception) -> None:
        for pending in self._pending.values():
            pending.reply.fail(failure)
        self._pending.clear()

    def _resolve_if_done(self, request_id: str) -> None:
        pending = self._pending.get(request_id)
        if pending is not None and all(sample.finish_reason is not None for sample in pending.samples):
            del self._pending[request_id]
            pending.reply.succeed([sample.to_output() for sample in pending.samples])

    def _abort(self, request_ids: frozenset[str] | None) -> None:
        aborted = self._batcher.abort(None if request_ids is None else set(request_ids))
        for request_id in {sample.request_id for sample in aborted}:
            self._resolve_if_done(request_id)

    def _loaded(self, version: int, adapter: str | None) -> None:
        """After a load: tokens from now on carry `version`, and keys and values of before are void. A named adapter's
        load changes its own rows and prefix-cache entries only: the base weights, and with them the other adapters'
        rows and entries, are as they were."""
        self._batcher.weights_loaded(adapter)
        if adapter is not None:
            self._batcher.adapter_versions[adapter] = version
            if self._recompute_kv_on_update:
                self._batcher.drop_adapter_rows(adapter)
            return
        self._version = version
        if self._recompute_kv_on_update:
            self._batcher.drop_cache()

    def _load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                      adapter: str | None) -> None:
        if adapter is None:
            self._weights.load(named_tensors)
        elif self._batcher.adapters is None:
            raise ValueError(f"update_weights: adapter {adapter!r}: kv_cache='static' does not serve named adapters "
                             "yet; use kv_cache='dynamic'")
        else:
            self._weights.load_adapter(adapter, list(named_tensors))
        self._loaded(version, adapter)

    def _refuse_leftover_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command.fail(RuntimeError("torch engine is closed"))


# ----- commands: what the async side asks the decode thread to do at the next step boundary ---------------


@dataclass
class _Submit(Command):
    request: base.GenerateRequest
    samples: list[DecodingSequence]

    def apply(self, engine: TorchEngine) -> object:
        request_id = self.request.request_id
        if request_id in engine._pending:
            raise ValueError(f"request {request_id!r} is already in flight on this engine")
        if self.request.adapter is not None:  # again on this thread: it may have been unloaded since submission
            engine._check_adapter(request_id, self.request.adapter)
        assert self.reply is not None
        engine._pending[request_id] = Pending(self.reply, self.samples)
        engine._batcher.add(self.samples)
        return DEFERRED


@dataclass
class _Abort(Command):
    request_ids: frozenset[str] | None

    def apply(self, engine: TorchEngine) -> object:
        engine._abort(self.request_ids)
        return None


@dataclass
class _Pause(Command):
    mode: base.PauseMode

    def apply(self, engine: TorchEngine) -> object:
        if self.mode == "abort":
            engine._abort(None)
        engine._paused = True
        return None


@dataclass
class _Resume(Command):
    def apply(self, engine: TorchEngine) -> object:
        engine._paused = False
        return None


@dataclass
class _UpdateWeights(Command):
    named_tensors: Iterable[tuple[str, torch.Tensor]]
    version: int
    adapter: str | None = None

    def apply(self, engine: TorchEngine) -> object:
        engine._load_weights(self.named_tensors, self.version, self.adapter)
        return None


@dataclass
class _UnloadAdapter(Command):
    adapter: str

    def apply(self, engine: TorchEngine) -> object:
        engine._unload_adapter(self.adapter)
        return None


@dataclass
class _Score(Command):
    input_ids: list[int]
    start: int
    temperature: float

    def apply(self, engine: TorchEngine) -> object:
        return score_tokens(engine._model, engine._vocab_size, self.input_ids, self.start, self.temperature)


@dataclass
class _Close(Command):
    def apply(self, engine: TorchEngine) -> object:
        engine._abort(None)
        engine._closed = True
        return None
