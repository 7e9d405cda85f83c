"""Which inference engine a rollout worker drives: `--rollout-engine` picks the `InferenceEngine` behind it.

`torch`: the embedded engine in the worker's own process. `sglang`: an SGLang server driven over HTTP, either
attached (`--sglang-url`, one per rollout worker: the worker with index i on its node takes the i-th URL, so
each node's command line lists its own workers' servers) or launched here as a child process
(`python -m {--sglang-server-module} --model-path ... --tp-size {--rollout-num-gpus-per-engine} ...` plus every
`--sglang-NAME VALUE`), which the engine restarts when it fails its health checks and stops on `close()`.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from actors.config import RunConfig

COMPAT_SERVER_MODULE = "engines.sglang.server"


def load_engine(config: RunConfig, actor_id: str | None = None) -> tuple[Any, Any]:
    """Build the engine and the tokenizer; blocking (the rollout worker calls it in a thread)."""
    from transformers import AutoTokenizer

    if config.hf_checkpoint is None:
        raise ValueError(
            f"--hf-checkpoint is required for the {config.rollout_engine} rollout engine (its tokenizer, "
            "and the weights the engine starts from)"
        )
    tokenizer = AutoTokenizer.from_pretrained(config.hf_checkpoint)
    if config.rollout_engine == "sglang":
        return load_sglang_engine(config, actor_id), tokenizer
    from engines.inference.torch_engine import TorchEngine

    engine = TorchEngine.from_pretrained(
        config.hf_checkpoint,
        max_batch_size=config.rollout_max_batch_size,
        device=engine_device(),
        dtype=torch.bfloat16 if config.bf16 else torch.float32,
    )
    return engine, tokenizer


def engine_device() -> torch.device:
    """The worker's own GPU when it has one: the launcher made it this process's only visible device, cuda:0."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def load_sglang_engine(config: RunConfig, actor_id: str | None) -> Any:
    from engines.sglang.client import SglangEngine
    from engines.sglang.launch import ServerProcess, ServerSpec

    if config.sglang_url:
        engine = SglangEngine(attached_url(config.sglang_url, actor_id))
        # An attached server may already serve updated weights (this worker restarted): start from its version.
        engine.set_version(server_weight_version(engine.url, timeout=config.sglang_startup_timeout))
        return engine
    assert config.hf_checkpoint is not None
    extra = dict(config.sglang_args)
    extra.setdefault("max-running-requests", str(config.rollout_max_batch_size))
    if config.sglang_server_module == COMPAT_SERVER_MODULE:
        # Our CPU stand-in: as many torch threads as the worker has, and groups that give up with the learner.
        extra.setdefault("torch-threads", str(config.torch_threads))
        extra.setdefault("weight-group-timeout", str(config.weight_transfer_timeout))
    spec = ServerSpec(
        model_path=config.hf_checkpoint,
        module=config.sglang_server_module,
        tp_size=config.rollout_num_gpus_per_engine,
        random_seed=engine_seed(config.seed, actor_id),
        # The launcher made this worker's GPUs its only visible ones, so its server starts at the first of them.
        base_gpu_id=0 if torch.cuda.is_available() else None,
        extra=extra,
    )
    server = ServerProcess(spec, startup_timeout=config.sglang_startup_timeout)
    return SglangEngine(server.start(), server=server)


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


def server_weight_version(url: str, *, timeout: float) -> int:
    """GET {url}/model_info's `weight_version`, blocking; "default" (never updated) reads as 0.

    SGLang removed `/get_weight_version` (0.5.15.post1 answers it with 404, 0.5.23 has no such route).
    """
    import json
    import urllib.request

    from engines.sglang.protocol import MODEL_INFO, parse_weight_version

    try:
        with urllib.request.urlopen(url.rstrip("/") + MODEL_INFO.path, timeout=timeout) as reply:
            body = json.loads(reply.read())
    except (OSError, ValueError) as error:
        raise ConnectionError(f"--sglang-url {url}: {MODEL_INFO.path} failed: {error}") from error
    version = parse_weight_version(body.get("weight_version") if isinstance(body, dict) else None)
    return version if version is not None else 0
