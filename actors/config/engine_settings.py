"""The run's engine settings: the inference engine each rollout worker drives, and the torch and SGLang engines'
own knobs (`RunConfig.engine`, read by the engine factory)."""

from __future__ import annotations

import warnings
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from actors.config.engines import engine_choices, engine_spec
from actors.config.plugin_marks import plugin_for
from actors.config.sections import BuiltinOrPlugin, Section
from actors.moved import MOVED_SERVER_MODULES
from policies.registry import BuiltinNames


class EngineConfig(Section):
    """The inference engine each rollout worker drives (SGLang's settings apply to --rollout-engine sglang)."""

    rollout_engine: Annotated[BuiltinOrPlugin, BuiltinNames(lambda: engine_choices("rollout_engine"))] = Field(
        "torch", description="the inference engine each rollout worker drives (a plugin: a factory (config, "
        "actor_id) -> (InferenceEngine, tokenizer))", json_schema_extra=plugin_for("rollout"))
    rollout_max_batch_size: int = Field(64, ge=1, description="sequences decoded together per engine")
    rollout_num_gpus_per_engine: int = Field(1, ge=1, description="GPUs (tensor parallel ranks) per SGLang server")
    sglang_url: list[str] = Field(default_factory=list, description="attach to these running SGLang servers "
                                  "(one per rollout worker, in worker order) instead of launching them")
    sglang_router_url: str | None = Field(
        None, description="an sglang-router (http://HOST:PORT) whose registered SGLang servers the rollout workers "
        "attach to, one each, as if given with --sglang-url: read once at start-up, on the node whose command line "
        "names it; servers that join the router later are not used (docs/router.md)")
    sglang_router_timeout: float = Field(60.0, gt=0, description="seconds to wait at start-up for --sglang-router-url "
                                         "to list at least one server")
    sglang_server_module: str = Field("sglang.launch_server", description="python -m module that starts a server")
    sglang_startup_timeout: float = Field(600.0, gt=0, description="seconds to wait for a launched server's health")
    sglang_args: dict[str, str | list[str]] = Field(
        default_factory=dict, description="extra SGLang server arguments; on the command line as --sglang-NAME "
        "VALUE [VALUE ...], passed on as --NAME VALUE [VALUE ...]")
    deterministic_inference: bool = Field(
        False, description="batch-invariant engines: a sample's tokens and log-probs do not depend on what else its "
        "engine decodes, so two synchronous runs with one --seed repeat bit for bit (torch engine: about 2-3x slower "
        "decoding; sglang: starts the server with --enable-deterministic-inference, which "
        "--sglang-enable-deterministic-inference also turns on)")

    torch_kv_cache: Literal["auto", "dynamic", "static"] = Field(
        "auto", description="the torch engine's KV cache: dynamic (caches sized to the running rows, the CPU's "
        "choice), static (one pool allocated at start, each decode step replayed from a CUDA graph on a GPU: 8-14x "
        "HF generate() on an H200, docs/gpu.md), auto (static on a GPU unless --deterministic-inference, else "
        "dynamic)")
    torch_kv_pool_columns: int | None = Field(
        None, ge=2, description="static KV cache: the prompt + response tokens one row may hold (requests longer "
        "are refused by name; default: --rollout-max-context-len, else the longest prompt the data allows plus "
        "the longest response, at least 4096)")
    torch_prefill_chunk_tokens: int = Field(
        8192, ge=1, description="torch engine: the most input tokens (rows x columns) one prefill forward runs, which "
        "bounds a prefill's activation memory; a longer prompt is prefilled chunk by chunk, one chunk per engine step "
        "between the running rows' decode steps (a 16k-token SmolLM2 prompt on a CPU: docs/long-prompts.md)")
    torch_prefix_cache: bool = Field(
        True, description="torch engine: keep the keys and values every request computed and reuse them for any later "
        "request that starts with the same tokens (the next turn of a conversation, a group's prompt arriving in "
        "another batch, a shared system prompt); stamped with the weights that computed them and never reused "
        "under others (docs/agents.md)")
    torch_prefix_cache_mb: int = Field(
        1024, ge=1, description="torch engine: the memory the prefix cache may take on the engine's device, in MiB "
        "(least recently used runs are evicted beyond it)")

    own_engines: int = Field(
        0, ge=0, description="a policy's setting (policies.NAME.own_engines) in a run of several: the rollout workers "
        "of its own it runs, each an engine of its own model (its --hf-checkpoint, trained in full or with its own "
        "LoRA), instead of sharing the run's engines as a LoRA adapter; `true` is 1 (docs/multi-policy.md)")

    def sglang_args_without_effect(self) -> list[str]:
        """The --sglang-NAME arguments the run's engine does not read (its spec's `reads_sglang_args`): on the torch
        engine all but two, which spell its own settings; an SGLang server or a plugin engine receives them all."""
        spec = engine_spec(self.rollout_engine)
        if spec is None or spec.reads_sglang_args is None:
            return []
        return [name for name in self.sglang_args if name not in spec.reads_sglang_args]

    @field_validator("sglang_server_module")
    @classmethod
    def _server_module_where_it_lives(cls, module: str) -> str:
        """The CPU stand-in server left `engines/` for `tools/standins/`; runs that name its old module still start."""
        if module in MOVED_SERVER_MODULES:
            warnings.warn(f"--sglang-server-module {module} moved to {MOVED_SERVER_MODULES[module]}; "
                          "using that", FutureWarning, stacklevel=2)
            return MOVED_SERVER_MODULES[module]
        return module

    @field_validator("sglang_router_url")
    @classmethod
    def _router_url_is_http(cls, url: str | None) -> str | None:
        if url is None:
            return None
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/"):
            raise ValueError(f"{url!r} is not a router's address: expected http://HOST:PORT")
        return url.rstrip("/")

    @model_validator(mode="after")
    def _servers_from_one_place(self) -> EngineConfig:
        """The router's servers are the run's SGLang servers: given as well with --sglang-url, which would win is
        a guess; a torch engine would attach to nothing."""
        if self.sglang_router_url is None:
            return self
        if self.sglang_url:
            raise ValueError(f"--sglang-router-url {self.sglang_router_url} and --sglang-url both name the SGLang "
                             "servers to attach to; give one")
        spec = engine_spec(self.rollout_engine)
        if spec is None or not spec.attaches:
            raise ValueError(f"--sglang-router-url {self.sglang_router_url} names SGLang servers to attach to: it "
                             f"needs --rollout-engine sglang (got {self.rollout_engine})")
        return self

    @model_validator(mode="before")
    @classmethod
    def _deterministic_through_sglang_flag(cls, values: Any) -> Any:
        """slime's spelling, `--sglang-enable-deterministic-inference`, asks for the same thing of any engine."""
        passed = (values.get("sglang_args") or {}).get("enable-deterministic-inference") if isinstance(
            values, dict) else None
        if passed is not None and str(passed).lower() not in ("false", "0"):
            return {**values, "deterministic_inference": True}
        return values

    @model_validator(mode="before")
    @classmethod
    def _no_prefix_cache_through_sglang_flag(cls, values: Any) -> Any:
        """slime's `--sglang-disable-radix-cache` turns SGLang's prefix cache off; a torch engine's goes with it."""
        passed = (values.get("sglang_args") or {}).get("disable-radix-cache") if isinstance(values, dict) else None
        if passed is not None and str(passed).lower() not in ("false", "0"):
            return {**values, "torch_prefix_cache": False}
        return values
