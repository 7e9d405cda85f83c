"""The run's configuration: one typed model, validated once, from which the command-line flags are made.

Flags follow slime's names (`--rollout-batch-size`, `--n-samples-per-prompt`, `--eps-clip-high`, ...). A YAML
file (`--config run.yaml`, keys in snake_case) sets any field; flags override the file; an unknown key or flag
is an error that names it. The effective configuration is written to the run directory, and every actor
receives it whole, so no process reads settings from anywhere else.
"""

from __future__ import annotations

import argparse
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from policies.config import PolicyLossConfig

# Built-in choices of the two plugin-capable engine settings; anything else must be a `module:attr` path.
ENGINE_CHOICES: dict[str, tuple[str, ...]] = {"train_backend": ("torch", "megatron"),
                                              "rollout_engine": ("torch", "sglang")}


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # ---- model and engines
    hf_checkpoint: str | None = Field(None, description="HF model folder (policy, reference and engines)")
    ref_checkpoint: str | None = Field(None, description="HF folder of the reference model (default: hf_checkpoint)")
    train_backend: str = Field("torch", description="training engine: torch, megatron, or module:attr of a "
                               "factory (config) -> Trainer")
    rollout_engine: str = Field("torch", description="inference engine: torch, sglang, or module:attr of a "
                                "factory (config, actor_id) -> (InferenceEngine, tokenizer)")

    @field_validator("train_backend", "rollout_engine")
    @classmethod
    def _builtin_or_plugin_path(cls, value: str, info: ValidationInfo) -> str:
        """A built-in name, or a plugin's `module:attr` (loaded by the actor that uses it, which checks its type)."""
        builtins = ENGINE_CHOICES[info.field_name or ""]
        module, colon, attr = value.partition(":")
        if value in builtins or (colon and module.strip() and attr.strip()):
            return value
        raise ValueError(f"{value!r}: expected one of {', '.join(builtins)}, or a plugin factory path "
                         "'package.module:attr'")
    torch_threads: int = Field(1, description="torch CPU threads per actor process")
    seed: int = Field(1234, description="seed of data order, sampling and initialisation")

    # ---- learner parallelism: learner_ranks = TP x PP x DP (the torch backend is data-parallel only)
    learner_ranks: int = Field(1, description="learner processes (torch.distributed ranks) started by the learner")
    tensor_model_parallel_size: int = Field(1, description="Megatron tensor parallel size")
    pipeline_model_parallel_size: int = Field(1, description="Megatron pipeline parallel size")
    use_distributed_optimizer: bool = Field(True, description="Megatron: shard optimizer state over data parallel")
    megatron_checkpoint: str | None = Field(None, description="Megatron distributed checkpoint to start from "
                                            "(default: convert --hf-checkpoint)")
    bf16: bool = Field(False, description="train in bfloat16 (float32 master weights and optimizer state), run the "
                       "engines in bfloat16 and push bfloat16 weights")

    # ---- placement (slime's flags); see actors/runtime/placement.py
    actor_num_nodes: int = Field(1, description="nodes of the learner (its ranks all run on the head for now)")
    actor_num_gpus_per_node: int | None = Field(None, description="learner GPUs per node: one learner rank each "
                                                "(sets --learner-ranks)")
    rollout_num_gpus: int | None = Field(None, description="GPUs of all inference engines; on the head, "
                                         "--rollout-workers defaults to rollout_num_gpus / "
                                         "rollout_num_gpus_per_engine")
    num_gpus_per_node: int | None = Field(None, description="GPUs a node may use (default: every GPU its "
                                          "launcher sees)")
    colocate: bool = Field(False, description="learner and engines on the same GPUs, taking turns (not available "
                           "yet: on one GPU the torch engine already shares the learner's device)")
    weight_transport: str = Field(
        "auto", description="how weights reach the engines: auto (gloo without CUDA, cuda_ipc when engines share "
        "the learner's GPU, nccl otherwise), gloo, nccl, cuda_ipc, or module:attr of a WeightTransport plugin")

    @field_validator("weight_transport")
    @classmethod
    def _backend_or_transport_path(cls, value: str) -> str:
        """A backend of the built-in mechanisms, or a plugin's `module:attr` (the learner loads and type-checks it)."""
        module, colon, attr = value.partition(":")
        if value in ("auto", "gloo", "nccl", "cuda_ipc") or (colon and module.strip() and attr.strip()):
            return value
        raise ValueError(f"{value!r}: expected auto, gloo, nccl, cuda_ipc, or a weight transport path "
                         "'package.module:attr'")

    # ---- SGLang rollout engine (--rollout-engine sglang)
    sglang_url: list[str] = Field(default_factory=list, description="attach to these running SGLang servers "
                                  "(one per rollout worker, in worker order) instead of launching them")
    sglang_server_module: str = Field("sglang.launch_server", description="python -m module that starts a server")
    rollout_num_gpus_per_engine: int = Field(1, description="GPUs (tensor parallel ranks) per SGLang server")
    sglang_startup_timeout: float = Field(600.0, description="seconds to wait for a launched server's health")
    sglang_args: dict[str, str] = Field(default_factory=dict, description="extra SGLang server arguments; on the "
                                        "command line as --sglang-NAME VALUE, passed on as --NAME VALUE")

    # ---- data
    prompt_data: str | None = Field(None, description="training prompts, .jsonl or .parquet")
    input_key: str = Field("input", description="prompt field of each record")
    label_key: str | None = Field("label", description="label field of each record")
    metadata_key: str | None = Field("metadata", description="metadata field of each record")
    apply_chat_template: bool = Field(False, description="wrap prompts with the tokenizer's chat template")
    skip_bad_data: bool = Field(True, description="skip (and report) malformed dataset lines instead of stopping")
    eval_prompt_data: list[str] = Field(default_factory=list,
                                        description="NAME PATH pairs of evaluation sets")
    eval_interval: int | None = Field(None, description="evaluate every N learner versions")
    n_samples_per_eval_prompt: int = Field(1, description="samples per eval prompt (pass@k uses them)")
    eval_temperature: float = Field(0.0, description="eval sampling temperature (0 = greedy)")
    final_eval_timeout: float = Field(300.0, description="seconds the end of a run waits for the eval round of "
                                      "the final version (0 = no final round)")

    # ---- rollout
    rollout_batch_size: int = Field(8, description="prompts (groups) per training batch")
    n_samples_per_prompt: int = Field(4, description="responses generated per prompt")
    global_batch_size: int | None = Field(None, description="samples per optimizer step; must equal "
                                          "rollout_batch_size x n_samples_per_prompt (one step per batch)")
    num_rollout: int = Field(20, description="training batches to consume (learner steps)")
    rollout_temperature: float = Field(1.0, description="sampling temperature")
    rollout_top_p: float = Field(1.0, description="top-p sampling")
    rollout_top_k: int = Field(0, description="top-k sampling (0 = off)")
    rollout_max_response_len: int = Field(32, description="max new tokens per response")
    rollout_stop: list[str] = Field(default_factory=list, description="stop strings")
    rollout_max_batch_size: int = Field(64, description="sequences decoded together per engine")
    custom_generate_function_path: str | None = Field(None, description="module:function for multi-turn rollouts")
    buffer_log_compact_mb: float = Field(256.0, description="compact the buffer's durable log into a snapshot "
                                         "once it passes this size (0 = never)")
    lease_timeout: float = Field(120.0, description="seconds before an unfinished prompt lease is re-issued")

    # ---- staleness and off-policy correction (the algorithm itself is in `policy`)
    max_staleness: int = Field(2, description="hard bound on learner_version - min(token versions); 0 = on-policy")
    use_decoupled_ppo: bool = Field(False, description="recompute proximal log-probs before the update (always "
                                    "done when --off-policy-correction is not none)")
    update_weights_interval: int = Field(1, description="push weights to engines every N learner steps")
    weight_transfer_timeout: float = Field(30.0, description="seconds a weight transfer waits for an engine "
                                           "(to join, be ready, acknowledge) before it fails and is retried")
    dynamic_sampling_filter_path: str | None = Field(None, description="module:function or built-in filter name")
    policy: PolicyLossConfig = Field(default_factory=lambda: PolicyLossConfig(off_policy_correction="tis"),
                                     description="advantages, loss, KL and off-policy correction")

    # ---- rewards
    rm_type: str = Field("exact_match", description="built-in reward name")
    custom_rm_path: str | None = Field(None, description="module:function reward (sync or async)")
    group_rm: bool = Field(False, description="the reward function scores whole groups")
    rm_url: str | None = Field(None, description="URL of a remote reward model (--rm-type remote_rm)")
    reward_timeout: float = Field(60.0, description="seconds before one reward call counts as failed")
    reward_concurrency: int = Field(4, description="groups scored at once per reward worker")

    # ---- optimizer
    lr: float = Field(1e-4, description="learning rate")
    lr_decay_style: Literal["constant", "cosine"] = Field("constant", description="LR schedule")
    lr_warmup_iters: int = Field(0, description="LR warmup steps")
    min_lr: float = Field(0.0, description="where the cosine schedule ends")
    weight_decay: float = Field(0.0, description="AdamW weight decay")
    adam_beta1: float = Field(0.9, description="AdamW beta1")
    adam_beta2: float = Field(0.999, description="AdamW beta2")
    clip_grad: float = Field(1.0, description="gradient norm clip")
    micro_batch_tokens: int = Field(8192, description="token budget of one packed micro-batch")

    # ---- checkpoints and state
    save: str | None = Field(None, description="checkpoint directory (default: RUN_DIR/checkpoints)")
    save_interval: int | None = Field(None, description="checkpoint every N learner steps")
    load: str | None = Field(None, description="resume from this checkpoint directory")

    # ---- debug
    debug_rollout_only: bool = Field(False, description="generate and score, never train")
    debug_train_only: bool = Field(False, description="train on --load-debug-rollout-data, no generation")
    save_debug_rollout_data: str | None = Field(None, description="write every batch to this directory")
    load_debug_rollout_data: str | None = Field(None, description="read batches from this directory")

    # ---- reporting
    use_tensorboard: bool = Field(True, description="write TensorBoard events to RUN_DIR/tensorboard")
    plots: bool = Field(True, description="write PNG plots at the end of the run")
    use_wandb: bool = Field(False, description="mirror the run's metrics into a Weights & Biases run "
                                               "(key: WANDB_API_KEY or `wandb login`)")
    wandb_project: str = Field("slipstream", description="W&B project")
    wandb_group: str | None = Field(None, description="W&B group, e.g. to gather the seeds of one experiment")
    wandb_mode: Literal["online", "offline"] = Field("online", description="offline: write RUN_DIR/wandb only, "
                                                                            "`wandb sync` it later")

    @model_validator(mode="before")
    @classmethod
    def _learner_ranks_from_actor_gpus(cls, values: Any) -> Any:
        """slime sizes the learner by --actor-num-nodes x --actor-num-gpus-per-node; both spellings must agree."""
        if not isinstance(values, dict) or values.get("actor_num_gpus_per_node") is None:
            return values
        ranks = int(values.get("actor_num_nodes") or 1) * int(values["actor_num_gpus_per_node"])
        given = values.get("learner_ranks")
        if given is not None and int(given) != ranks:
            raise ValueError(
                f"learner_ranks {given} disagrees with actor_num_nodes x actor_num_gpus_per_node = {ranks}"
            )
        return {**values, "learner_ranks": ranks}

    @model_validator(mode="after")
    def _cross_checks(self) -> RunConfig:
        problems = []
        if self.n_samples_per_prompt < 1:
            problems.append("n_samples_per_prompt must be >= 1")
        if self.rollout_batch_size < 1:
            problems.append("rollout_batch_size must be >= 1")
        if self.max_staleness < 0:
            problems.append("max_staleness must be >= 0")
        samples = self.rollout_batch_size * self.n_samples_per_prompt
        if self.global_batch_size is not None and self.global_batch_size != samples:
            problems.append(f"global_batch_size {self.global_batch_size}: several optimizer steps per batch are not "
                            f"supported yet; leave it unset or set it to rollout_batch_size x n_samples_per_prompt "
                            f"= {samples}")
        if not 0 <= self.min_lr <= self.lr:
            problems.append(f"min_lr {self.min_lr} must be in [0, lr={self.lr}]")
        if len(self.eval_prompt_data) % 2:
            problems.append("eval_prompt_data takes NAME PATH pairs")
        if self.eval_prompt_data and not self.eval_interval:
            problems.append("eval_prompt_data needs eval_interval")
        if self.debug_rollout_only and self.debug_train_only:
            problems.append("debug_rollout_only and debug_train_only are exclusive")
        if self.debug_train_only and not self.load_debug_rollout_data:
            problems.append("debug_train_only needs load_debug_rollout_data")
        parallel = self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        if self.learner_ranks < 1 or self.learner_ranks % parallel:
            problems.append(f"learner_ranks {self.learner_ranks} must be a positive multiple of "
                            f"tensor_model_parallel_size x pipeline_model_parallel_size = {parallel}")
        if self.actor_num_nodes != 1:
            problems.append(f"actor_num_nodes {self.actor_num_nodes}: the learner's ranks all run on the head node "
                            "for now; use --actor-num-nodes 1 with --actor-num-gpus-per-node N")
        if self.colocate:
            problems.append("colocate: not available yet; on a single GPU, --rollout-engine torch shares the "
                            "learner's GPU without it (weights over CUDA IPC)")
        if self.rollout_num_gpus is not None and self.rollout_num_gpus_per_engine >= 1 and (
            self.rollout_num_gpus < 0 or self.rollout_num_gpus % self.rollout_num_gpus_per_engine
        ):
            problems.append(f"rollout_num_gpus {self.rollout_num_gpus} must be a non-negative multiple of "
                            f"rollout_num_gpus_per_engine {self.rollout_num_gpus_per_engine}")
        if self.rollout_num_gpus_per_engine < 1:
            problems.append("rollout_num_gpus_per_engine must be >= 1")
        if self.num_gpus_per_node is not None and self.num_gpus_per_node < 0:
            problems.append("num_gpus_per_node must be >= 0")
        if parallel > 1 and self.train_backend != "megatron":
            problems.append("tensor/pipeline parallelism needs --train-backend megatron")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def samples_per_batch(self) -> int:
        return self.rollout_batch_size * self.n_samples_per_prompt

    @property
    def eval_sets(self) -> dict[str, str]:
        pairs = self.eval_prompt_data
        return {pairs[i]: pairs[i + 1] for i in range(0, len(pairs), 2)}


# ------------------------------------------------------------------------------------- flags <-> fields
def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return annotation, False


# slime's negative switches for policy fields, accepted as flags and YAML keys.
POLICY_SWITCHES = {
    "disable_grpo_std_normalization": "Dr.GRPO: centre rewards per group without dividing by their std",
    "disable_rewards_normalization": "use raw rewards as advantages (no group baseline)",
}
# Where Slipstream's default differs from PolicyLossConfig's: the fully-async mode corrects with TIS (RL losses
# only; SFT has no behaviour policy to correct for).
POLICY_DEFAULTS = {"off_policy_correction": "tis"}


def _policy_fields() -> dict[str, Any]:
    return {name: field for name, field in PolicyLossConfig.model_fields.items()}


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting; defaults stay None so only flags given on the command line override."""
    group = parser.add_argument_group("training run (also settable in --config YAML)")
    group.add_argument("--config", type=Path, default=None, help="YAML file of run settings (snake_case keys)")
    run_fields = {n: f for n, f in RunConfig.model_fields.items() if n != "policy"}
    _add_model_flags(group, run_fields)
    algorithm = parser.add_argument_group("algorithm: advantages, loss, KL, off-policy correction")
    _add_model_flags(algorithm, _policy_fields(), defaults=POLICY_DEFAULTS)
    for name, help_text in POLICY_SWITCHES.items():
        algorithm.add_argument(_flag(name), dest=name, action="store_true", default=None, help=help_text)


def _add_model_flags(group: Any, fields: dict[str, Any], defaults: dict[str, Any] | None = None) -> None:
    for name, field in fields.items():
        annotation, _ = _unwrap_optional(field.annotation)
        default = field.default if field.default_factory is None else field.default_factory()
        default = (defaults or {}).get(name, default)
        help_text = field.description or name.replace("_", " ")
        if default is not None and "(default:" not in help_text:
            help_text += f" (default: {default})"
        if typing.get_origin(annotation) is dict:
            continue  # set in YAML, or by a pass-through flag family (see split_sglang_args)
        if annotation is bool:
            group.add_argument(_flag(name), dest=name, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)
        elif typing.get_origin(annotation) is list:
            group.add_argument(_flag(name), dest=name, nargs="*", default=None, help=help_text)
        elif typing.get_origin(annotation) is Literal:
            group.add_argument(_flag(name), dest=name, choices=typing.get_args(annotation), default=None,
                               help=help_text)
        else:
            kind = annotation if annotation in (int, float) else str
            group.add_argument(_flag(name), dest=name, type=kind, default=None, help=help_text)


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """YAML first, then every flag the user gave; errors name the file, key or flag that is wrong."""
    values: dict[str, Any] = {}
    source = "command line"
    if args.config is not None:
        source = str(args.config)
        try:
            loaded = yaml.safe_load(Path(args.config).read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError) as error:
            raise ValueError(f"--config {args.config}: {error}") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"--config {args.config}: expected a mapping of settings, got {type(loaded).__name__}")
        unknown = sorted(set(loaded) - _known_keys())
        if unknown:
            raise ValueError(f"--config {args.config}: unknown key(s) {', '.join(unknown)}")
        values.update(loaded)
    for name in _known_keys():
        given = getattr(args, name, None)
        if given is not None:
            values[name] = given
    passed_through = getattr(args, "sglang_passthrough", None)
    if passed_through:
        values["sglang_args"] = {**values.get("sglang_args", {}), **passed_through}
    return build_config(values, source=source)


SGLANG_PREFIX = "--sglang-"


def split_sglang_args(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """Take `--sglang-NAME VALUE` (or `--sglang-NAME=VALUE`, or a bare switch) out of argv for the SGLang server.

    SGLang has hundreds of server arguments; forwarding a prefixed family keeps them out of our flag list while
    letting a user set any of them. A bare switch is forwarded as the value "true". Our own `sglang_*` settings
    (`--sglang-url`, `--sglang-server-module`, ...) stay in argv for the ordinary flag parser.
    """
    rest: list[str] = []
    found: dict[str, str] = {}
    index = 0
    while index < len(argv):
        token = argv[index]
        name, has_value, value = token[len(SGLANG_PREFIX):].partition("=")
        own_setting = "sglang_" + name.replace("-", "_") in RunConfig.model_fields  # --sglang-url etc. are ours
        if not token.startswith(SGLANG_PREFIX) or token == SGLANG_PREFIX or own_setting:
            rest.append(token)
            index += 1
            continue
        if not has_value:
            following = argv[index + 1] if index + 1 < len(argv) else None
            if following is not None and not following.startswith("--"):
                value = following
                index += 1
            else:
                value = "true"
        found[name.replace("_", "-")] = value
        index += 1
    return rest, found


def _known_keys() -> set[str]:
    return (set(RunConfig.model_fields) - {"policy"}) | set(PolicyLossConfig.model_fields) | set(POLICY_SWITCHES)


def build_config(values: dict[str, Any], *, source: str = "settings") -> RunConfig:
    """Flat settings (run and algorithm keys mixed, as in YAML and flags) -> a validated RunConfig."""
    policy_keys = set(PolicyLossConfig.model_fields) | set(POLICY_SWITCHES)
    given = {k: v for k, v in values.items() if k in policy_keys}
    defaults = POLICY_DEFAULTS if given.get("loss_type") not in ("sft", "sft_loss") else {}
    policy_flags = {**defaults, **given}
    run_values = {k: v for k, v in values.items() if k not in policy_keys}
    try:
        policy = PolicyLossConfig.from_flags(policy_flags)
    except (ValidationError, ValueError) as error:
        raise ValueError(f"invalid algorithm settings ({source}): {_describe(error)}") from None
    try:
        return RunConfig(**run_values, policy=policy)
    except ValidationError as error:
        raise ValueError(f"invalid run settings ({source}): {_describe(error)}") from None


def _describe(error: Exception) -> str:
    if isinstance(error, ValidationError):
        return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'config'}: {e['msg']}" for e in error.errors())
    return str(error)


def write_effective_config(config: RunConfig, run_dir: Path) -> Path:
    path = run_dir / "config.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), encoding="utf-8")
    return path
