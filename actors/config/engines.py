"""The built-in engines (inference engines and training backends) and what each one is: the one place a run's
engine-dependent choices are read from.

`--rollout-engine` names a built-in (a key of `BUILTIN_ENGINES`) or a plugin factory `module:attr`. Placement, the
config's cross-checks, the learner's choice of weight transport and the engine factory ask an engine's traits
(`engine_spec`), never its name, so a third built-in engine is one more entry here. A plugin has no spec: it gets
the conservative answer everywhere (not colocatable, no HTTP server, weights over torch.distributed), and declares
only whether it needs a GPU, as an attribute of its factory (`needs_gpu = False`).

`--train-backend` is the same: a key of `BUILTIN_TRAIN_BACKENDS` or a plugin factory `module:attr`, and the config's
cross-checks, the trainer factory and the process template ask `train_backend_spec`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from engines.weights.names import DISK, SGLANG, SGLANG_DISK, SGLANG_LORA, SGLANG_TENSOR, TORCH_DISTRIBUTED
from policies.plugins import load_object

WeightBackend = Literal["gloo", "nccl", "cuda_ipc", "shm", "disk"]


@dataclass(frozen=True)
class EngineSpec:
    """A built-in engine's traits. `factory` has a plugin factory's signature, `(config, actor_id) -> (engine,
    tokenizer)`, named by path so that reading the traits imports neither torch nor the engine."""

    factory: str
    noun: str  # the engine in an error message: "the torch engine", "an SGLang server"
    plural: str  # engines of its kind in an error message: "torch engines", "SGLang servers"
    needs_gpu: bool = True  # takes --rollout-num-gpus-per-engine GPUs of its own on a GPU node
    shares_learner_gpu: bool = False  # on a node short of GPUs, its workers may share learner rank 0's GPU
    colocatable: bool = False  # --colocate: hands its memory to the learner between turns
    loads_checkpoint: bool = True  # starts from --hf-checkpoint (weights and tokenizer)
    records_routes: bool = False  # --use-rollout-routing-replay: returns each token's routed experts
    serves_http: bool = False  # slime's plugins can call it over HTTP (args.sglang_router_ip/port)
    attaches: bool = False  # attaches to running servers (--sglang-url, or those --sglang-router-url lists)
    weight_transport: str = TORCH_DISTRIBUTED  # how pushed weights reach it (engines.weights.transport)
    colocated_weight_transport: str | None = None  # under --colocate, when that differs
    lora_weight_transport: str | None = None  # a LoRA run's adapters, when that differs
    disk_weight_transport: str = DISK  # --weight-transport disk: through a shared folder
    lora_target_check: str | None = None  # `module:attr` refusing --target-modules the engine cannot adapt
    serves_named_adapters: bool = False  # serves several LoRA adapters at once, each request naming its own
    serves_fp8: bool = False  # --rollout-fp8: serves block-scaled FP8 projections and loads FP8 pushes
    # `module:attr` (hf config, tp size, where) -> problems: the projections it cannot serve in FP8 tiles
    fp8_shape_check: str | None = None
    cpu_standin: str | None = None  # the flags that run a stand-in for it on a machine without GPUs
    # the --sglang-NAME arguments it reads (None: every one, an SGLang server's command line)
    reads_sglang_args: tuple[str, ...] | None = None

    def transport(self, *, colocate: bool, lora: bool, disk: bool = False) -> str:
        """The weight transport this engine receives a run's pushes through (a LoRA adapter wins over a shared
        folder, which wins over colocation)."""
        if lora and self.lora_weight_transport:
            return self.lora_weight_transport
        if disk:
            return self.disk_weight_transport
        if colocate and self.colocated_weight_transport:
            return self.colocated_weight_transport
        return self.weight_transport


BUILTIN_ENGINES: dict[str, EngineSpec] = {
    "torch": EngineSpec(
        factory="actors.rollout.engine_factory:load_torch_engine", noun="the torch engine", plural="torch engines",
        shares_learner_gpu=True,  # it loads pushes over CUDA IPC from the learner's device
        colocatable=True, records_routes=True, serves_named_adapters=True, serves_fp8=True,
        # slime's spellings of two of its own settings (EngineConfig's validators)
        reads_sglang_args=("enable-deterministic-inference", "disable-radix-cache")),
    "sglang": EngineSpec(
        factory="actors.rollout.engine_factory:load_sglang_engine", noun="an SGLang server", plural="SGLang servers",
        colocatable=True, records_routes=True, serves_http=True, attaches=True,
        weight_transport=SGLANG,
        colocated_weight_transport=SGLANG_TENSOR,  # by reference, no broadcast
        lora_weight_transport=SGLANG_LORA,  # the server loads each adapter by name
        disk_weight_transport=SGLANG_DISK,  # each push a checkpoint its /update_weights_from_disk reads
        serves_named_adapters=True,  # each policy's adapter versions by name, each request naming its policy's
        serves_fp8=True, fp8_shape_check="engines.sglang.fp8_serving:block_shape_problems",  # an FP8 checkpoint
        lora_target_check="engines.sglang.protocol:lora_target_modules",
        cpu_standin="--sglang-server-module tools.standins.sglang_server"),
}

@dataclass(frozen=True)
class TrainBackendSpec:
    """A built-in training backend's traits. `factory` has a plugin trainer factory's signature, `(config) ->
    Trainer`, named by path so that reading the traits imports neither torch nor megatron-core.

    A plugin backend has no spec: it holds no model the process template should preload, gets no model
    parallelism, critic or in-learner teacher, and reads `config.lora` itself if it adapts."""

    factory: str
    model_parallel: bool = False  # tensor, pipeline and expert parallelism (it shards the batch itself)
    critic: bool = False  # trains a value model beside the policy (PPO's GAE)
    routing_replay: bool = False  # replays MoE routes (its own pi_old forward's, or the engines')
    teachers_in_learner: bool = False  # holds distillation teachers in the learner's process
    stateless_adam: bool = False  # trains with slime's stateless Adam (--use-stateless-adam)
    no_lora_because: str | None = None  # why LoRA cannot run on it, or None where it can
    no_images_because: str | None = None  # why it cannot train a vision-language model, or None where it can

    @property
    def lora(self) -> bool:
        return self.no_lora_because is None


BUILTIN_TRAIN_BACKENDS: dict[str, TrainBackendSpec] = {
    "torch": TrainBackendSpec(factory="actors.learner.trainer_factory:build_torch_trainer", critic=True,
                              routing_replay=True, teachers_in_learner=True, stateless_adam=True),
    "megatron": TrainBackendSpec(
        factory="actors.learner.trainer_factory:build_megatron_trainer", model_parallel=True, routing_replay=True,
        teachers_in_learner=True,
        no_lora_because="megatron-core 0.16 and mbridge have no LoRA layers; Megatron-Bridge's PEFT needs "
                        "Transformer Engine",
        no_images_because="mbridge's Qwen2.5-VL model builds its vision tower and projection from Transformer "
                          "Engine layers, which do not install beside this stack, and the Megatron trainer builds "
                          "text-only GPT models; --train-backend torch trains vision-language models"),
}


def engine_choices(setting: str) -> tuple[str, ...]:
    """The built-in names of a plugin-capable engine setting (`train_backend`, `rollout_engine`), none for any
    other; anything else must be a `module:attr` path. Read when asked, so a registered engine spec counts at once."""
    return {"train_backend": tuple(BUILTIN_TRAIN_BACKENDS), "rollout_engine": tuple(BUILTIN_ENGINES)}.get(setting, ())


def train_backend_spec(name: str) -> TrainBackendSpec | None:
    """The built-in training backend `name` names, or None for a plugin path."""
    return BUILTIN_TRAIN_BACKENDS.get(name)


def train_backends_that(trait: str) -> str:
    """The built-in training backends with `trait`, as a flag in words ("--train-backend torch or megatron")."""
    return "--train-backend " + " or ".join(name for name, spec in BUILTIN_TRAIN_BACKENDS.items()
                                            if getattr(spec, trait))


def engine_spec(name: str) -> EngineSpec | None:
    """The built-in engine `name` names, or None for a plugin path."""
    return BUILTIN_ENGINES.get(name)


def engines_that(trait: str) -> list[str]:
    """The built-in engines whose boolean `trait` is true, for messages that say which engines would do."""
    return [name for name, spec in BUILTIN_ENGINES.items() if getattr(spec, trait)]


def kinds_that(trait: str, conjunction: str) -> str:
    """The built-in engines whose boolean `trait` is true, in words ("torch engines and SGLang servers")."""
    return f" {conjunction} ".join(BUILTIN_ENGINES[name].plural for name in engines_that(trait))


def engine_needs_gpu(rollout_engine: str) -> bool:
    """Whether a rollout worker's engine takes GPUs of its own on a GPU node.

    A built-in's spec says. A plugin factory declares otherwise with an attribute `needs_gpu = False` (an engine
    that calls a remote API, the pipeline benchmark's sleeping engine); without one it is given GPUs, as slime
    gives every rollout engine its `--rollout-num-gpus-per-engine`.
    """
    spec = engine_spec(rollout_engine)
    if spec is not None:
        return spec.needs_gpu
    needs_gpu = getattr(load_object(rollout_engine, what="--rollout-engine"), "needs_gpu", True)
    if not isinstance(needs_gpu, bool):
        raise ValueError(f"--rollout-engine {rollout_engine!r}: needs_gpu is "
                        f"{type(needs_gpu).__name__} {needs_gpu!r}, expected True or False")
    return needs_gpu


def http_engine_problem(rollout_engine: str, what: str) -> str | None:
    """Why `what` (a slime plugin that calls the engine over HTTP) cannot run on this run's engine, or None.
    A plugin engine is given the benefit of the doubt here; the plugin then finds no URL on it and says so."""
    spec = engine_spec(rollout_engine)
    if spec is None or spec.serves_http:
        return None
    choices = " or ".join(f"--rollout-engine {name}" + (f" (on CPU add {server.cpu_standin})" if server.cpu_standin
                                                           else "")
                          for name, server in BUILTIN_ENGINES.items() if server.serves_http)
    return (f"{what} calls the engine over HTTP (args.sglang_router_ip/port), and --rollout-engine "
            f"{rollout_engine} serves none; use {choices}")


def weight_backend(*, cuda: bool, shared: bool, colocate: bool = False) -> WeightBackend:
    """How weights travel between processes: gloo without CUDA (shared-memory files when colocated on the learner's
    host), CUDA IPC when the engines share the learner's GPU (`shared`), else NCCL."""
    if not cuda:
        return "shm" if colocate else "gloo"
    if shared:
        return "cuda_ipc"
    return "nccl"
