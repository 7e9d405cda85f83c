"""The whole run's configuration: one section per component, plus the rules that tie sections together.

Every actor receives the whole `RunConfig` (it is small and the run directory keeps it), but reads only its own
sections; engines and trainers get their own option objects built from these, never the run config itself.
Settings arrive flat (flags and YAML keys are slime's names); `RunConfig` routes each name to the one section
that owns it, so `RunConfig(lr=1e-5)` and `RunConfig(trainer={"lr": 1e-5})` are the same run.
"""

from __future__ import annotations

import urllib.parse
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from actors.config.data_source import SourceConfig, source_problems
from actors.config.engine_settings import EngineConfig
from actors.config.engines import engine_spec, kinds_that, train_backend_spec, train_backends_that
from actors.config.evaluation import EvalConfig
from actors.config.megatron import MegatronConfig
from actors.config.policies import override_problems, own_engines_problems, sharing_engines
from actors.config.profiling import ProfilingConfig
from actors.config.rollout_buffer import rollout_buffer_problems
from actors.config.rollout_fp8 import rollout_fp8_problems
from actors.config.router import RouterConfig
from actors.config.sections import (
    AgentConfig,
    BufferConfig,
    ControllerConfig,
    DataConfig,
    LearnerConfig,
    LoggingConfig,
    LoraConfig,
    ModelConfig,
    PlacementConfig,
    RewardConfig,
    RolloutConfig,
    Section,
    TrainerConfig,
    resolve_label_key,
)
from actors.config.sft import SftConfig
from actors.config.slime_table import SLIME_FLAGS
from actors.config.teachers import DistillationConfig, run_teachers
from actors.config.weights_settings import WeightsConfig
from policies.config import PolicyLossConfig
from policies.pi_old import pi_old_source
from policies.plugins import load_object

SECTIONS: dict[str, type[Section]] = {
    "model": ModelConfig, "data": DataConfig, "eval": EvalConfig, "rollout": RolloutConfig, "agent": AgentConfig,
    "buffer": BufferConfig, "reward": RewardConfig, "learner": LearnerConfig, "trainer": TrainerConfig,
    "lora": LoraConfig, "engine": EngineConfig, "router": RouterConfig, "weights": WeightsConfig,
    "placement": PlacementConfig,
    "controller": ControllerConfig, "logging": LoggingConfig, "megatron": MegatronConfig,
    "distillation": DistillationConfig, "sft": SftConfig, "profiling": ProfilingConfig, "source": SourceConfig,
}
# Flat setting name -> the section that owns it (names are unique across sections: they are the flags).
OWNER: dict[str, str] = {field: section for section, model in SECTIONS.items() for field in model.model_fields}


_EVAL_SET_VIEWS: dict[tuple[int, str], tuple[RunConfig, RunConfig]] = {}  # (id, set) -> (a config, its view)


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = Field(1234, description="seed of data order, sampling and initialisation")
    torch_threads: int = Field(1, ge=1, description="torch CPU threads per actor process")
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    source: SourceConfig = Field(default_factory=SourceConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    controller: ControllerConfig = Field(default_factory=ControllerConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    distillation: DistillationConfig = Field(default_factory=DistillationConfig)
    sft: SftConfig = Field(default_factory=SftConfig)
    profiling: ProfilingConfig = Field(default_factory=ProfilingConfig)
    policy: PolicyLossConfig = Field(default_factory=PolicyLossConfig,
                                     description="advantages, loss, KL and off-policy correction")
    policies: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="several policies co-trained in one run: name -> the flat settings it "
        "sets for itself (prompt_data, lr, max_staleness, ...); each is a LoRA adapter on the shared engines, or "
        "with own_engines a model on engines of its own (actors.config.policies). Empty: one unnamed policy")
    custom_config: dict[str, Any] = Field(
        default_factory=dict, description="settings of the run's own slime-style plugins, which read them as "
        "args.<key> (slime's --custom-config-path YAML); a key that names one of our settings or slime's flags is "
        "refused")

    @model_validator(mode="before")
    @classmethod
    def _route_flat_settings(cls, values: Any) -> Any:
        """Move each flat setting into its section (a flat name overrides the same name given inside a section)."""
        if not isinstance(values, dict):
            return values
        routed: dict[str, Any] = {}
        for name, value in values.items():
            if name in SECTIONS and isinstance(value, BaseModel):
                value = value.model_dump()
            if name in SECTIONS:
                routed[name] = {**routed.get(name, {}), **value} if isinstance(value, dict) else value
        for name, value in values.items():
            if name in OWNER:
                section = routed.setdefault(OWNER[name], {})
                if not isinstance(section, dict):
                    raise ValueError(f"{name}: section {OWNER[name]!r} must be a mapping")
                section[name] = value
            elif name not in SECTIONS:
                routed[name] = value  # run-wide fields, and unknown names for extra="forbid" to name
        return _colocated_on_policy(_learner_ranks_from_actor_gpus(routed))

    @property
    def eval_record_keys(self) -> tuple[str, str | None]:
        """The prompt and label keys of eval records: --eval-input-key / --eval-label-key, else the training
        data's; `--eval-label-key none` says eval records carry no label even where training records do."""
        own = self.eval.eval_label_key
        label = self.data.label_key if own is None else resolve_label_key(own)
        return self.eval.eval_input_key or self.data.input_key, label

    @property
    def eval_tool_key(self) -> str | None:
        """The tool definitions key of eval records: --eval-tool-key, else the training data's --tool-key."""
        own = self.eval.eval_tool_key
        return self.data.tool_key if own is None else resolve_label_key(own)

    @property
    def optimizer_steps_per_batch(self) -> int:
        """Optimizer steps per rollout batch: --num-steps-per-rollout, else the batch / --global-batch-size, else 1.

        slime's rule: num_steps_per_rollout sets global_batch_size = samples per batch // N, and a
        global_batch_size given as well must agree (`_batch_split_problems` refuses a mismatch). The samples counted
        are episodes, as slime counts rollouts: an agent's episode of several segments is one, and the learner cuts
        its steps on episodes (`actors.learner.stages.mini_batches`)."""
        learner = self.learner
        if learner.num_steps_per_rollout is not None:
            return learner.num_steps_per_rollout
        if learner.global_batch_size is not None:
            return max(1, self.rollout.samples_per_batch // learner.global_batch_size)
        return 1

    def _batch_split_problems(self) -> list[str]:
        """Each optimizer step takes an equal share of the batch, so the share must be a whole number of samples."""
        samples, learner = self.rollout.samples_per_batch, self.learner
        where = f"rollout_batch_size x n_samples_per_prompt = {samples}"
        steps, size = learner.num_steps_per_rollout, learner.global_batch_size
        if steps is not None:
            if samples % steps:
                return [f"num_steps_per_rollout {steps} must divide {where}"]
            if size is not None and size != samples // steps:
                return [f"global_batch_size {size} disagrees with num_steps_per_rollout {steps}: {where} / {steps} "
                        f"= {samples // steps}; set one of them"]
        elif size is not None and (size > samples or samples % size):
            return [f"global_batch_size {size} must divide {where} (one optimizer step per {size} samples)"]
        return []

    def _length_problems(self) -> list[str]:
        """A prompt cap must leave at least one response token inside the context cap (as slime asserts)."""
        problems = []
        context = self.rollout.rollout_max_context_len
        pairs = [("rollout", self.data.rollout_max_prompt_len, context),
                 ("eval", self.eval.eval_max_prompt_len, self.eval.eval_max_context_len or context)]
        for kind, prompt, limit in pairs:
            if prompt is not None and limit is not None and prompt > limit - 1:
                problems.append(f"{kind}_max_prompt_len {prompt} must be at most {kind}_max_context_len - 1 = "
                                f"{limit - 1} (room for one response token)")
        return problems

    def for_eval_set(self, name: str | None) -> RunConfig:
        """This config as eval set `name` sees it: its own settings (`--eval-config`) applied; itself for a set without
        any, or for None. Raises ValueError naming the set when a value is invalid."""
        settings = self.eval.eval_set_settings.get(name) if name is not None else None
        if not settings:
            return self
        cached = _EVAL_SET_VIEWS.get((id(self), name))
        if cached is not None and cached[0] is self:
            return cached[1]
        sections: dict[str, dict[str, Any]] = {}
        for key, value in settings.items():
            sections.setdefault(OWNER[key], {})[key] = value
        try:
            updates = {section: type(getattr(self, section))(**{**getattr(self, section).model_dump(), **values})
                       for section, values in sections.items()}
        except ValidationError as error:
            raise ValueError(f"eval set {name!r}: {error}") from None
        view = self.model_copy(update=updates)
        _EVAL_SET_VIEWS[(id(self), name)] = (self, view)
        return view

    @property
    def holds_back_stops(self) -> bool:
        """Whether some eval set has a minimum response length (the engines must hold stop tokens back)."""
        return any(self.for_eval_set(name).eval.eval_min_new_tokens for name in self.eval.sets)

    def _eval_set_problems(self) -> list[str]:
        """Each set's own settings name a set of the run and are valid for it; a minimum eval length needs a KV
        cache that can hold tokens back (the static pool's decode graph cannot)."""
        problems = [f"eval set {name!r} has settings but is not an eval set of this run (sets: "
                    f"{', '.join(self.eval.sets) or 'none'})"
                    for name in self.eval.eval_set_settings if name not in self.eval.sets]
        for name in self.eval.sets:
            try:
                view = self.for_eval_set(name)
            except ValueError as error:
                problems.append(str(error))
                continue
            if view.eval.eval_min_new_tokens and self.engine.torch_kv_cache == "static":
                problems.append(f"eval_min_new_tokens (eval set {name!r}): the static KV cache holds back no "
                                "tokens; use --torch-kv-cache dynamic (or auto, which picks it)")
        return problems

    @model_validator(mode="after")
    def _cross_checks(self) -> RunConfig:
        """Rules that involve more than one section; each message names every setting involved."""
        problems = []
        problems += self._batch_split_problems()
        if self.trainer.min_lr > self.trainer.lr:
            problems.append(f"min_lr {self.trainer.min_lr} must be in [0, lr={self.trainer.lr}]")
        for name in ("eval_prompt_data", "eval_function_path"):
            if getattr(self.eval, name) and not self.eval.eval_interval:
                problems.append(f"{name} needs eval_interval")
        problems += self._length_problems()
        problems += self._eval_set_problems()
        problems += _custom_config_problems(self)
        problems += source_problems(self.source, self.rollout, self.agent, self.sft)
        problems += rollout_fp8_problems(self.weights, self.engine, lora=self.lora.enabled)
        lag = self.weights.update_weights_interval - 1
        if self.buffer.max_staleness < lag:  # engines would wait, or generate only what the buffer must evict
            problems.append(f"max_staleness {self.buffer.max_staleness} must be at least update_weights_interval - 1 "
                            f"= {lag}: between pushes the engines run weights up to {lag} versions old")
        if self.learner.debug_rollout_only and self.learner.debug_train_only:
            problems.append("debug_rollout_only and debug_train_only are exclusive")
        if self.learner.debug_train_only and not self.learner.load_debug_rollout_data:
            problems.append("debug_train_only needs load_debug_rollout_data")
        trainer = self.trainer
        parallel = trainer.tensor_model_parallel_size * trainer.pipeline_model_parallel_size
        if trainer.learner_ranks % parallel:
            problems.append(f"learner_ranks {trainer.learner_ranks} must be a positive multiple of "
                            f"tensor_model_parallel_size x pipeline_model_parallel_size = {parallel}")
        context = self.megatron.context_parallel_size
        if trainer.learner_ranks % context:
            problems.append(f"learner_ranks {trainer.learner_ranks} must be a multiple of context_parallel_size "
                            f"{context}: each row is split across that many ranks, each data-parallel replica has "
                            "its own")
        backend = train_backend_spec(trainer.train_backend)
        model_parallel = backend is not None and backend.model_parallel
        if parallel > 1 and not model_parallel:
            problems.append(f"tensor/pipeline parallelism needs {train_backends_that('model_parallel')}")
        megatron = self.megatron
        experts = megatron.expert_model_parallel_size * (megatron.expert_tensor_parallel_size
                                                         or trainer.tensor_model_parallel_size)
        stage_ranks = trainer.learner_ranks // trainer.pipeline_model_parallel_size
        if megatron.expert_model_parallel_size > 1 and not model_parallel:
            problems.append(f"expert parallelism needs {train_backends_that('model_parallel')}")
        elif megatron.expert_model_parallel_size > 1 and stage_ranks % experts:
            problems.append(f"learner_ranks {trainer.learner_ranks} over pipeline_model_parallel_size "
                            f"{trainer.pipeline_model_parallel_size} must be a multiple of "
                            f"expert_tensor_parallel_size x expert_model_parallel_size = {experts}: experts are "
                            "split over data-parallel ranks")
        placement = self.placement
        if trainer.learner_ranks % placement.actor_num_nodes:
            problems.append(f"learner_ranks {trainer.learner_ranks} must be a multiple of actor_num_nodes "
                            f"{placement.actor_num_nodes}: every node of the learner runs as many ranks")
        if placement.actor_num_nodes > 1 and placement.colocate:
            problems.append("colocate with actor_num_nodes > 1: a colocated learner is one rank, beside its engines")
        if placement.learner_world_address is not None:
            problems.extend(_world_address_problems(placement.learner_world_address))
        if self.lora.enabled:
            problems.extend(_lora_problems(self))
        if placement.colocate:
            problems.extend(_colocate_problems(self))
        per_engine = self.engine.rollout_num_gpus_per_engine
        if placement.rollout_num_gpus is not None and placement.rollout_num_gpus % per_engine:
            problems.append(f"rollout_num_gpus {placement.rollout_num_gpus} must be a multiple of "
                            f"rollout_num_gpus_per_engine {per_engine}")
        problems.extend(_distillation_problems(self))
        problems.extend(_critic_problems(self))
        problems.extend(_routing_replay_problems(self))
        problems.extend(_pi_old_and_reference_problems(self))
        problems.extend(_policies_problems(self))
        backend = train_backend_spec(self.trainer.train_backend)
        if self.trainer.use_stateless_adam and (backend is None or not backend.stateless_adam):
            problems.append(f"use_stateless_adam needs {train_backends_that('stateless_adam')} (the Megatron "
                            "backend runs megatron's own Adam)")
        problems.extend(rollout_buffer_problems(self.agent, self.rollout, self.policy,
                                                decoupled=self.learner.use_decoupled_ppo,
                                                steps_per_batch=self.optimizer_steps_per_batch))
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def with_settings(self, **flat: Any) -> RunConfig:
        """A validated copy with some flat settings changed (`model_copy` would skip validation and routing)."""
        return RunConfig(**{**self.model_dump(), **flat})


def _custom_config_problems(config: RunConfig) -> list[str]:
    """slime lets its --custom-config-path YAML overwrite any of its args, and so does the translation here
    (`slime_flags._custom_config_flags`): a key that names a slime flag is that flag, one that names a setting of
    ours sets it. A key naming a setting that the run's value disagrees with (a custom config given some other way),
    or an SGLang server setting, would be a setting silently not taken: refused, by name."""
    slime_flags = {flag[2:].replace("-", "_") for flag in SLIME_FLAGS}
    taken = []
    for key, value in config.custom_config.items():
        if key in slime_flags:
            continue
        section = OWNER.get(key, "policy" if key in PolicyLossConfig.model_fields else None)
        if section is not None:
            if getattr(getattr(config, section), key) != value:
                taken.append(key)
        elif key in RunConfig.model_fields or key.startswith("sglang_"):
            taken.append(key)
    if not taken:
        return []
    return [f"custom_config (--custom-config-path): {', '.join(sorted(taken))} name run settings or SGLang server "
            "settings it does not set; give them as flags (or --config keys, --sglang-NAME), and keep the custom "
            "config for the plugins' own settings"]


def _world_address_problems(address: str) -> list[str]:
    parts = urllib.parse.urlsplit(address)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or not parts.hostname or not port:
        return [f"learner_world_address {address!r}: expected tcp://HOST:PORT"]
    return []


def learner_ranks_per_node(config: RunConfig) -> int:
    """Learner ranks each of the learner's nodes runs (the head: ranks 0..G-1)."""
    return config.trainer.learner_ranks // config.placement.actor_num_nodes


def _colocated_on_policy(values: dict[str, Any]) -> dict[str, Any]:
    """--colocate without a --max-staleness means 0: the learner and the engines take turns, so the engines only
    ever generate with the weights of the step that comes next. Without a --router-policy it means local: an engine
    that handed its memory to the learner must not be woken by another worker's call."""
    placement, buffer, router = values.get("placement"), values.get("buffer"), values.get("router")
    if not (isinstance(placement, dict) and placement.get("colocate")):
        return values
    buffer = dict(buffer) if isinstance(buffer, dict) else {}
    buffer.setdefault("max_staleness", 0)
    router = dict(router) if isinstance(router, dict) else {}
    router.setdefault("router_policy", "local")
    return {**values, "buffer": buffer, "router": router}


def _colocate_problems(config: RunConfig) -> list[str]:
    problems = []
    if config.buffer.max_staleness != 0:
        problems.append(f"colocate: max_staleness {config.buffer.max_staleness}; colocated runs are on-policy by "
                        "construction (the engines and the learner take turns on the same devices), so leave "
                        "--max-staleness at 0")
    spec = engine_spec(config.engine.rollout_engine)
    if spec is None or not spec.colocatable:
        problems.append(f"colocate: --rollout-engine {config.engine.rollout_engine}; colocated mode runs "
                        f"{kinds_that('colocatable', 'or')}, which hand their memory to the learner between turns")
    if config.weights.weight_transport in ("gloo", "nccl"):
        problems.append(f"colocate: --weight-transport {config.weights.weight_transport} broadcasts; colocated "
                        "engines read the learner's memory (cuda_ipc on a GPU, shm on CPUs, or auto)")
    if config.router.router_policy != "local":
        problems.append(f"colocate: --router-policy {config.router.router_policy}; a colocated engine hands its "
                        "memory to the learner whenever its own worker has nothing to generate, so calls from other "
                        "workers must not reach it: leave --router-policy at local")
    return problems


def _lora_problems(config: RunConfig) -> list[str]:
    """Where a LoRA adapter cannot go yet, said at start-up rather than by a failed first weight push."""
    problems = []
    backend = train_backend_spec(config.trainer.train_backend)
    if backend is not None and backend.no_lora_because:
        problems.append(f"lora_rank: LoRA needs {train_backends_that('lora')} ({backend.no_lora_because})")
    spec = engine_spec(config.engine.rollout_engine)
    if spec is not None and spec.lora_target_check is not None:
        try:
            load_object(spec.lora_target_check, what="lora_target_check")(config.lora.target_modules)
        except ValueError as error:
            problems.append(f"--target-modules with --rollout-engine {config.engine.rollout_engine}: {error}")
    return problems


def _learner_ranks_from_actor_gpus(values: dict[str, Any]) -> dict[str, Any]:
    """slime sizes the learner by --actor-num-nodes x --actor-num-gpus-per-node; both spellings must agree."""
    placement = values.get("placement")
    if not isinstance(placement, dict) or placement.get("actor_num_gpus_per_node") is None:
        return values
    ranks = int(placement.get("actor_num_nodes") or 1) * int(placement["actor_num_gpus_per_node"])
    trainer = values.get("trainer")
    trainer = dict(trainer) if isinstance(trainer, dict) else {}
    given = trainer.get("learner_ranks")
    if given is not None and int(given) != ranks:
        raise ValueError(f"learner_ranks {given} disagrees with actor_num_nodes x actor_num_gpus_per_node = {ranks}")
    return {**values, "trainer": {**trainer, "learner_ranks": ranks}}


def _distillation_problems(config: RunConfig) -> list[str]:
    """What makes a distillation setup unusable, said at start-up; each message names the settings involved."""
    settings = config.distillation
    try:
        teachers = run_teachers(settings)
    except ValueError as error:
        return [str(error)]
    problems = []
    if config.policy.use_opd and not teachers:
        problems.append("use_opd needs a teacher: --opd-teacher-load PATH, --opd-teacher NAME=SOURCE, or slime's "
                        "--opd-type sglang with --rm-url")
    if teachers and not config.policy.use_opd:
        problems.append(f"teachers are set ({', '.join(teachers)}) but use_opd is off: add --use-opd")
    if settings.opd_type == "megatron" and settings.opd_teacher_load is None:
        problems.append("opd_type megatron needs --opd-teacher-load (the teacher the learner holds)")
    if settings.opd_type == "sglang" and settings.opd_teacher_load is not None:
        problems.append("opd_type sglang: the teacher is a server, so --opd-teacher-load must not be set (as slime)")
    if len(teachers) > 1 and settings.opd_teacher_key is None:
        problems.append(f"{len(teachers)} teachers ({', '.join(teachers)}) need --opd-teacher-key, the dataset "
                        "field that names each prompt's teacher")
    if config.policy.use_opd and config.learner.custom_advantage_function_path is not None:
        problems.append("use_opd with --custom-advantage-function-path: the function replaces the estimator, the "
                        "distillation term and whitening; add the term in it (each sample carries "
                        "teacher_log_probs beside its log-probs)")
    held = [name for name, teacher in teachers.items() if teacher.in_learner]
    backend = train_backend_spec(config.trainer.train_backend)
    if held and (backend is None or not backend.teachers_in_learner):
        problems.append(f"teachers held by the learner ({', '.join(held)}) need "
                        f"{train_backends_that('teachers_in_learner')}; on "
                        f"{config.trainer.train_backend} give the teacher as a server (--opd-teacher NAME=URL)")
    return problems


def _critic_problems(config: RunConfig) -> list[str]:
    """A critic (an estimator whose trait says it reads values: ppo, or a plugin that declares it): where it can
    run, and its settings only with it."""
    if config.policy.needs_critic:
        estimator = config.policy.advantage_estimator
        backend = train_backend_spec(config.trainer.train_backend)
        if backend is None or not backend.critic:
            return [f"advantage_estimator {estimator} trains a critic beside the policy, which "
                    f"{train_backends_that('critic')} does; --train-backend {config.trainer.train_backend} has no "
                    "value model (use grpo, reinforce_plus_plus or rloo there)"]
        if config.learner.custom_advantage_function_path is not None:
            return [f"advantage_estimator {estimator} with --custom-advantage-function-path: the critic trains on "
                    "the GAE returns of its own values, which a custom function (it gives advantages only) replaces"]
        return []
    given = [flag for flag, value in (("--num-critic-only-steps", config.learner.num_critic_only_steps),
                                      ("--critic-load", config.trainer.critic_load),
                                      ("--critic-lr", config.trainer.critic_lr)) if value]
    if given:
        return [f"{', '.join(given)}: a critic is trained only with an estimator that reads values "
                f"(--advantage-estimator ppo, or a plugin declaring NEEDS_CRITIC), not "
                f"{config.policy.advantage_estimator}"]
    return []


def _replays_routes(config: RunConfig) -> bool:
    backend = train_backend_spec(config.trainer.train_backend)
    return backend is not None and backend.routing_replay


def _routing_replay_problems(config: RunConfig) -> list[str]:
    """--use-routing-replay records routes in the learner's own pi_old forward: the torch backend and a recipe with
    one. --use-rollout-routing-replay takes them from the engines (SGLang servers, or torch engines on their dynamic
    cache) into either backend."""
    if config.trainer.use_rollout_routing_replay:
        if not _replays_routes(config):
            return ["--use-rollout-routing-replay: MoE routes are replayed by "
                    f"{train_backends_that('routing_replay')}; --train-backend {config.trainer.train_backend} does "
                    "not"]
        spec = engine_spec(config.engine.rollout_engine)
        if spec is None or not spec.records_routes:
            return [f"--use-rollout-routing-replay: {kinds_that('records_routes', 'and')} record routed experts; "
                    f"--rollout-engine {config.engine.rollout_engine} does not"]
        if config.engine.torch_kv_cache == "static":
            return ["--use-rollout-routing-replay: the static KV cache does not record routed experts yet; use "
                    "--torch-kv-cache dynamic (or auto, which picks it for routing replay)"]
    if not config.trainer.use_routing_replay:
        return []
    if not _replays_routes(config):
        return [f"--use-routing-replay: the learner's own routes are recorded and replayed by "
                f"{train_backends_that('routing_replay')}; "
                f"--train-backend {config.trainer.train_backend} does not"]
    source = pi_old_source(config.policy, decoupled=config.learner.use_decoupled_ppo,
                           steps_per_batch=config.optimizer_steps_per_batch)
    if source == "rollout":
        remedy = ("drop --use-rollout-logprobs" if config.policy.use_rollout_logprobs
                  else "add --use-decoupled-ppo or an --off-policy-correction")
        return ["--use-routing-replay records the experts in the learner's pi_old forward, which this recipe does not "
                f"run (pi_old is the engine's log-probs): {remedy}"]
    return []


def _pi_old_and_reference_problems(config: RunConfig) -> list[str]:
    """slime's --use-rollout-logprobs against our own way of asking for a recomputed pi_old, and what
    --ref-update-interval needs: a reference model of its own to copy the policy into."""
    problems = []
    if config.policy.use_rollout_logprobs and config.learner.use_decoupled_ppo:
        problems.append("use_rollout_logprobs (pi_old is the engine's log-probs, nothing recomputed) and "
                        "use_decoupled_ppo (pi_old recomputed before the update) contradict; give one of them")
    problems.extend(_advantages_off_problems(config))
    interval = config.trainer.ref_update_interval
    if interval is not None and not config.policy.needs_ref:
        problems.append(f"ref_update_interval {interval}: this run has no reference model to refresh (one is "
                        "loaded for a KL term: use_kl_loss, or kl_coef > 0)")
    if interval is not None and config.lora.enabled:
        problems.append(f"ref_update_interval {interval} with lora_rank {config.lora.lora_rank}: a LoRA run's "
                        "reference is the base model, the policy with its adapter off, which the policy trains on; "
                        "making it the current policy would mean merging the adapter into those base weights")
    return problems


def _advantages_off_problems(config: RunConfig) -> list[str]:
    """slime's --disable-compute-advantages-and-returns leaves the advantages to a hook or to a loss of the user's:
    with a built-in policy-gradient loss and no hook to set them, every advantage would be zero and the step would
    train nothing (slime fails on the missing key at the first batch); a custom advantage function would not run."""
    learner, loss = config.learner, config.policy.loss_type
    if not learner.disable_compute_advantages_and_returns or loss == "sft":
        return []
    if learner.custom_advantage_function_path is not None:
        return ["disable_compute_advantages_and_returns and custom_advantage_function_path contradict: the function "
                "computes the advantages the first turns off; give one of them"]
    if learner.rollout_data_postprocess_path is None and not any(mark in loss for mark in ":."):
        return [f"disable_compute_advantages_and_returns with loss_type {loss!r}: its advantages would all be zero, "
                "so the step would train nothing; set them in --rollout-data-postprocess-path, or use a custom loss "
                "(--custom-loss-function-path) or --loss-type sft_loss"]
    return []


def policy_names(config: RunConfig) -> tuple[str, ...]:
    """The run's policies in declaration order (actors.config.policies); () for a run of one unnamed policy."""
    return tuple(config.policies)


def policy_run_config(config: RunConfig, policy: str, overrides: dict[str, Any] | None = None) -> RunConfig:
    """`config` as the actors of `policy` read it: the run's settings with the policy's overrides on top (`overrides`:
    those of a policy that joined the running job, which the run's settings do not hold)."""
    if overrides is None and policy not in config.policies:
        known = ", ".join(config.policies) or "none: the run has one unnamed policy"
        raise KeyError(f"policy {policy!r} is not one of the run's policies ({known})")
    return _with_overrides(config, config.policies[policy] if overrides is None else overrides)


def _with_overrides(config: RunConfig, overrides: dict[str, Any]) -> RunConfig:
    settings = {**config.model_dump(), "policies": {}}
    loss = set(PolicyLossConfig.model_fields)  # the loss section takes no flat names (flags.py routes them): here
    settings["policy"] = {**settings["policy"], **{k: v for k, v in overrides.items() if k in loss}}
    return RunConfig(**settings, **{k: v for k, v in overrides.items() if k not in loss})


def _policies_problems(config: RunConfig) -> list[str]:
    """What makes the run's `policies` unusable; each message names the policy and the setting."""
    if not config.policies:
        return []
    problems, shared, spec = own_engines_problems(config), sharing_engines(config.policies), engine_spec(
        config.engine.rollout_engine)  # the rules below hold for the policies on the run's engines
    if shared and not config.lora.enabled:
        problems.append(f"policies ({', '.join(shared)}) share the base model's engines as LoRA adapters: "
                        "set --lora-rank (each policy trains its own adapter)")
    if shared and (spec is None or not spec.serves_named_adapters):
        problems.append(f"policies: --rollout-engine {config.engine.rollout_engine} does not serve several named "
                        f"adapters at once; {kinds_that('serves_named_adapters', 'or')} do")
    if config.placement.colocate:
        problems.append("policies with --colocate: a colocated engine hands its memory to one learner; several "
                        "policies' learners run beside shared engines")
    if config.rollout.rollout_function_path is not None:
        problems.append("policies with --rollout-function-path: a whole-rollout function leases and sends for one "
                        "policy; give a --custom-generate-function-path, which each policy's groups go through")
    if config.trainer.learner_ranks > 1 or config.placement.actor_num_nodes > 1:
        problems.append(f"policies with learner_ranks {config.trainer.learner_ranks} / actor_num_nodes "
                        f"{config.placement.actor_num_nodes}: each policy's learner is one rank for now")
    section_of = {**OWNER, **{name: "policy" for name in PolicyLossConfig.model_fields}}
    for name, overrides in config.policies.items():
        found = override_problems(name, overrides, section_of)
        problems += found
        if found:
            continue
        try:
            _with_overrides(config, overrides)
        except ValidationError as error:
            problems.extend(f"policies.{_where(name, item['loc'])}: {item['msg'].removeprefix('Value error, ')}"
                            for item in error.errors())
    return problems


def _where(policy: str, location: tuple[Any, ...]) -> str:
    """`policy.lr` for an error at `("trainer", "lr")`; the policy alone for a rule across sections."""
    named = [str(part) for part in location if isinstance(part, str)]
    return f"{policy}.{named[-1]}" if named else policy
