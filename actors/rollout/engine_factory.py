"""Which inference engine a rollout worker drives: `--rollout-engine` picks the `InferenceEngine` behind it.

`torch`: the embedded engine in the worker's own process. `sglang`: an SGLang server driven over HTTP, either
attached (`--sglang-url`, one per rollout worker: the worker with index i on its node takes the i-th URL, so
each node's command line lists its own workers' servers) or launched here as a child process
(`python -m {--sglang-server-module} --model-path ... --tp-size {--rollout-num-gpus-per-engine} ...` plus every
`--sglang-NAME VALUE`), which the engine restarts when it fails its health checks and stops on `close()`.
`module:attr`: a plugin factory with `load_engine`'s signature (the pipeline benchmark's sleeping engine is one).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from actors.config import RunConfig
from actors.config.engines import engine_spec
from actors.config.policies import TORCH_ENGINE_ADAPTERS, sglang_loras_per_batch, sharing_engines
from actors.config.rollout_fp8 import rolls_out_fp8
from actors.rollout.generate import Tokenizer
from engines.inference.base import InferenceEngine
from policies.plugins import load_object

if TYPE_CHECKING:
    import torch

    from engines.sglang.client import MoeRoutes, SglangEngine

EngineFactory = Callable[[RunConfig, "str | None"], "tuple[InferenceEngine, Tokenizer]"]
"""`--rollout-engine module:attr` names one: `(config, actor_id) -> (engine, tokenizer)`, blocking."""


def load_engine(config: RunConfig, actor_id: str | None = None) -> tuple[InferenceEngine, Tokenizer]:
    """Build the engine and the tokenizer; blocking (the rollout worker calls it in a thread).

    A built-in engine is a factory like a plugin's, which its spec names (`actors.config.engines`). torch and
    transformers are imported only by the built-in factories: a worker whose engine is a plugin (or a remote
    server) never loads them.
    """
    name = config.engine.rollout_engine
    spec = engine_spec(name)
    if spec is None:
        return load_plugin_engine(name, config, actor_id)
    if spec.loads_checkpoint and config.model.hf_checkpoint is None:
        raise ValueError(f"--hf-checkpoint is required for the {name} rollout engine (its tokenizer, and the weights "
                         "the engine starts from)")
    return load_plugin_engine(spec.factory, config, actor_id)


def load_torch_engine(config: RunConfig, actor_id: str | None) -> tuple[InferenceEngine, Tokenizer]:
    """`--rollout-engine torch`: the embedded engine, in the worker's own process."""
    import torch

    from engines.inference.torch_engine import TorchEngine
    from engines.training.lora import LoraSettings

    tokenizer = checkpoint_tokenizer(config)
    adapter = LoraSettings.of_run(config.lora)
    device = engine_device()
    assert config.model.hf_checkpoint is not None
    engine = TorchEngine.from_pretrained(
        config.model.hf_checkpoint,
        max_batch_size=config.engine.rollout_max_batch_size,
        device=device,
        dtype=torch.bfloat16 if config.model.bf16 else torch.float32,
        seed=engine_seed(config.seed, actor_id),  # requests carry their own seeds; this covers unseeded ones
        # A LoRA run's updates are adapters, which the engine folds into its weights at the run's scale.
        lora_scaling=adapter.scaling if adapter is not None else None,
        # colocated: the learner trains on this device whenever generation pauses for its next weights
        release_memory_when_idle=config.placement.colocate,
        deterministic=config.engine.deterministic_inference,
        kv_cache=torch_kv_cache(config, device),
        kv_pool_columns=kv_pool_columns(config),
        record_routes=config.trainer.use_rollout_routing_replay,
        prefix_cache_bytes=prefix_cache_bytes(config),
        prefill_chunk_tokens=config.engine.torch_prefill_chunk_tokens,
        # a run of several policies: each one's adapter, served by the policy's name, fresh until its learner pushes
        adapters=tuple(sharing_engines(config.policies)),
        max_adapters=TORCH_ENGINE_ADAPTERS,  # what a policy joining the run may take (actors.config.policies)
        image_limits=config.data.image_limits,
        fp8=rolls_out_fp8(config.weights, config.model.hf_checkpoint),
    )
    return engine, tokenizer


def load_sglang_engine(config: RunConfig, actor_id: str | None) -> tuple[InferenceEngine, Tokenizer]:
    """`--rollout-engine sglang`: a server driven over HTTP, attached (--sglang-url) or launched here."""
    tokenizer = checkpoint_tokenizer(config)
    return sglang_engine(config, actor_id), tokenizer


def checkpoint_tokenizer(config: RunConfig) -> Tokenizer:
    """--hf-checkpoint's tokenizer, with the worker's torch threads set first (the built-in engines' common start)."""
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(config.torch_threads)
    return AutoTokenizer.from_pretrained(config.model.hf_checkpoint)


def prefix_cache_bytes(config: RunConfig) -> int:
    """`--torch-prefix-cache-mb` in bytes, or 0 under `--no-torch-prefix-cache`."""
    return config.engine.torch_prefix_cache_mb << 20 if config.engine.torch_prefix_cache else 0


def torch_kv_cache(config: RunConfig, device: torch.device) -> str:
    """`--torch-kv-cache auto`: the static pool and its CUDA graphs on a GPU, where decoding is launch-bound;
    caches sized to the rows on a CPU, where compute follows the cache (and for batch-invariant decoding, recorded
    routes and a minimum eval length, which the static pool does not do yet)."""
    chosen = config.engine.torch_kv_cache
    if chosen != "auto":
        return chosen
    dynamic_only = (config.engine.deterministic_inference or config.trainer.use_rollout_routing_replay
                    or _vision_language(config.model.hf_checkpoint) or config.holds_back_stops)
    return "static" if device.type == "cuda" and not dynamic_only else "dynamic"


def _vision_language(checkpoint: str | None) -> bool:
    """The checkpoint is a local vision-language folder (images run on the dynamic layout only, for now)."""
    from engines.checkpoint_config import is_vision_language

    config = Path(checkpoint) / "config.json" if checkpoint else None
    return config is not None and config.is_file() and is_vision_language(json.loads(config.read_text()))


def kv_pool_columns(config: RunConfig) -> int:
    """Tokens per row of a static pool: what the run lets one request reach (see `--torch-kv-pool-columns`)."""
    if config.engine.torch_kv_pool_columns is not None:
        return config.engine.torch_kv_pool_columns
    contexts = [config.rollout.rollout_max_context_len, config.eval.eval_max_context_len]
    if any(contexts):
        return max(context for context in contexts if context)
    prompt = config.data.rollout_max_prompt_len or 0
    response = max(config.rollout.rollout_max_response_len, config.eval.eval_max_response_len or 0)
    return max(4096, prompt + response)


def load_plugin_engine(path: str, config: RunConfig, actor_id: str | None) -> tuple[InferenceEngine, Tokenizer]:
    """Call the factory `path` names and check what it returns, so a wrong plugin fails at start-up by name."""
    factory = load_object(path, what="--rollout-engine")
    if not callable(factory):
        raise TypeError(f"--rollout-engine {path!r}: {type(factory).__name__} is not callable; expected a factory "
                        "(config, actor_id) -> (InferenceEngine, tokenizer)")
    built = factory(config, actor_id)
    if not (isinstance(built, tuple) and len(built) == 2):
        raise TypeError(f"--rollout-engine {path!r}: the factory returned {type(built).__name__}, expected a pair "
                        "(InferenceEngine, tokenizer)")
    engine, tokenizer = built
    if not isinstance(engine, InferenceEngine):
        raise TypeError(f"--rollout-engine {path!r}: the factory's engine is a {type(engine).__name__}, not an "
                        "engines.inference.base.InferenceEngine")
    if not isinstance(tokenizer, Tokenizer):
        raise TypeError(f"--rollout-engine {path!r}: the factory's tokenizer ({type(tokenizer).__name__}) lacks "
                        "what actors.rollout.generate.Tokenizer declares (__call__, decode, apply_chat_template, "
                        "eos_token_id)")
    return engine, tokenizer


def engine_device() -> torch.device:
    """The worker's own GPU when it has one: the launcher made it this process's only visible device, cuda:0."""
    import torch

    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def sglang_engine(config: RunConfig, actor_id: str | None) -> SglangEngine:
    import torch

    from engines.sglang.adapter_endpoints import AdapterServing
    from engines.sglang.client import SglangEngine
    from engines.sglang.fp8_serving import attached_problem, launch_checkpoint
    from engines.sglang.launch import ServerProcess, ServerSpec

    engine_config = config.engine
    fp8 = rolls_out_fp8(config.weights, config.model.hf_checkpoint)
    # A LoRA run's pushes are adapters, which the server loads by name (engines/sglang/adapter_sync.py); a run of
    # several policies has one per policy that shares the run's engines.
    shared = tuple(sharing_engines(config.policies))
    adapters = (AdapterServing(config.lora.lora_alpha, config.lora.lora_sync_dir, shared)
                if config.lora.enabled else None)
    release_tags = colocated_release_tags(config)
    routes = moe_routes(config)
    if engine_config.sglang_url:
        engine = SglangEngine(attached_url(engine_config.sglang_url, actor_id), adapters=adapters,
                              release_tags=release_tags, moe_routes=routes)
        # An attached server may already serve updated weights (this worker restarted): start from its version.
        engine.set_version(attached_server_version(engine.url, timeout=engine_config.sglang_startup_timeout))
        if fp8 and (problem := attached_problem(engine.url, timeout_s=30.0)) is not None:
            raise ValueError(problem)
        return engine
    assert config.model.hf_checkpoint is not None
    spec = ServerSpec(
        # --rollout-fp8: SGLang serves FP8 from an FP8 checkpoint only, the conversion of --hf-checkpoint
        model_path=str(launch_checkpoint(config.model.hf_checkpoint, engine_config.rollout_num_gpus_per_engine))
        if fp8 else config.model.hf_checkpoint,
        module=engine_config.sglang_server_module,
        tp_size=engine_config.rollout_num_gpus_per_engine,
        random_seed=engine_seed(config.seed, actor_id),
        # The launcher made this worker's GPUs its only visible ones, so its server starts at the first of them.
        base_gpu_id=0 if torch.cuda.is_available() else None,
        extra=sglang_server_args(config),
    )
    server = ServerProcess(spec, startup_timeout=engine_config.sglang_startup_timeout)
    return SglangEngine(server.start(), server=server, adapters=adapters, release_tags=release_tags,
                        moe_routes=routes)


def moe_routes(config: RunConfig) -> MoeRoutes | None:
    """--use-rollout-routing-replay: how the checkpoint's routes are shaped: SGLang records every layer
    (`num_hidden_layers`) with `num_experts_per_tok` experts each; the learner replays its MoE layers' only."""
    if not config.trainer.use_rollout_routing_replay:
        return None
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from engines.sglang.client import MoeRoutes
    from engines.training.moe import router_modules

    assert config.model.hf_checkpoint is not None
    model_config = AutoConfig.from_pretrained(config.model.hf_checkpoint)
    top_k = getattr(model_config, "num_experts_per_tok", None)
    if not top_k:
        raise ValueError(f"--use-rollout-routing-replay: {config.model.hf_checkpoint} is not a mixture-of-experts "
                         "model (its config has no num_experts_per_tok)")
    with torch.device("meta"):  # the architecture alone, no weights: which layers route
        skeleton = AutoModelForCausalLM.from_config(model_config)
    names = {id(module): name for name, module in skeleton.named_modules()}
    layers = tuple(_layer_index(names[id(router)]) for router in router_modules(skeleton))
    return MoeRoutes(int(model_config.num_hidden_layers), layers, int(top_k))


def _layer_index(module_name: str) -> int:
    """The decoder layer a module sits in, from its name (`model.layers.3.mlp.gate` -> 3)."""
    match = re.search(r"\.layers\.(\d+)\.", module_name)
    if match is None:
        raise ValueError(f"--use-rollout-routing-replay: cannot tell which layer the router {module_name} is in")
    return int(match[1])


def colocated_release_tags(config: RunConfig) -> tuple[str, ...]:
    """The memory a colocated server hands the learner while it trains: its KV cache and CUDA graphs, and its
    weights too where the server keeps a CPU copy of them (`--sglang-enable-weights-cpu-backup`) and pushes are
    whole weights. Without the copy SGLang frees the weights' contents, and an eval round of the current version
    may still need them before the next push comes; an adapter run's pushes never rewrite the base weights."""
    from engines.sglang import protocol

    if not config.placement.colocate:
        return ()
    keeps_copy = "enable-weights-cpu-backup" in config.engine.sglang_args and not config.lora.enabled
    weights = (protocol.MEMORY_WEIGHTS,) if keeps_copy else ()
    return (*weights, protocol.MEMORY_KV_CACHE, protocol.MEMORY_CUDA_GRAPH)


def sglang_server_args(config: RunConfig) -> dict[str, str | list[str]]:
    """The server arguments of a launched SGLang server beyond model, parallelism and seed: every --sglang-NAME,
    then what the run's own flags imply (a user's --sglang-NAME wins where both set one)."""
    engine_config = config.engine
    extra = dict(engine_config.sglang_args)
    extra.setdefault("max-running-requests", str(engine_config.rollout_max_batch_size))
    if engine_config.deterministic_inference:
        extra["enable-deterministic-inference"] = "true"
    if config.model.bf16:  # the dtype the weights are pushed in; "auto" would follow the checkpoint (often float32)
        extra.setdefault("dtype", "bfloat16")
    if config.lora.enabled:
        extra.update(lora_server_args(config))
        if shared := sharing_engines(config.policies):  # room for every adapter, those they replace and the base
            extra.setdefault("max-loras-per-batch", str(sglang_loras_per_batch(len(shared))))
    if config.placement.colocate:  # the learner shares the GPU: the server hands its memory over between turns
        extra.setdefault("enable-memory-saver", "true")
    if config.trainer.use_rollout_routing_replay:
        from engines.sglang.protocol import ROUTED_EXPERTS_FLAG

        extra[ROUTED_EXPERTS_FLAG] = "true"
    return extra


def lora_server_args(config: RunConfig) -> dict[str, str | list[str]]:
    """The SGLang flags that make room for the run's adapter: LoRA on, its rank, the modules it adapts."""
    from engines.sglang.protocol import lora_target_modules

    return {
        "enable-lora": "true",
        "max-lora-rank": str(config.lora.lora_rank),
        "lora-target-modules": lora_target_modules(config.lora.target_modules),
    }


def engine_seed(seed: int, actor_id: str | None) -> int:
    """A distinct sampling seed per server (`rollout-<node>-<index>`), so two engines never draw the same samples."""
    match = re.search(r"-(\d+)-(\d+)$", actor_id or "")
    if match is None:
        return seed
    node, index = int(match.group(1)), int(match.group(2))
    return seed + 1000 * node + index


def attached_url(urls: list[str], actor_id: str | None) -> str:
    """The URL of this worker's server: `rollout-<node>-<index>` takes `urls[index]`."""
    if actor_id is None:
        if len(urls) == 1:
            return urls[0]
        raise ValueError(
            f"--sglang-url lists {len(urls)} servers but the rollout worker's id is unknown; "
            "load_engine(config, actor_id) picks by the worker's index"
        )
    match = re.search(r"(\d+)$", actor_id)
    if match is None:
        raise ValueError(f"rollout worker id {actor_id!r} does not end in its index")
    index = int(match.group(1))
    if index >= len(urls):
        raise ValueError(
            f"--sglang-url lists {len(urls)} servers, too few for rollout worker {actor_id} "
            f"(index {index}); give one per rollout worker on this node"
        )
    return urls[index]


def attached_server_version(url: str, *, timeout: float) -> int:
    """The weight version an attached server already serves, blocking, once it is healthy (it may still be
    loading); "default" (never updated) reads as 0.

    The reading itself is `SglangEngine.server_weight_version` (the one place that knows `/model_info`); this runs
    it on a short-lived client of its own, since the factory runs in a worker thread without an event loop.
    """
    from engines.sglang.client import SglangEngine, SglangError
    from engines.sglang.launch import wait_for_attached_server

    wait_for_attached_server(url, timeout_s=timeout)

    async def read() -> int | None:
        probe = SglangEngine(url, control_timeout=timeout)
        try:
            return await probe.server_weight_version()
        finally:
            await probe.close()

    try:
        version = asyncio.run(read())
    except SglangError as error:
        raise ConnectionError(f"--sglang-url {url}: {error}") from error
    return version if version is not None else 0
