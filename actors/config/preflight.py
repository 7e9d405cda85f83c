"""What the launcher checks before any actor starts: the settings that can be checked in a second or two.

An actor finds a bad setting only when it uses it, after its start-up, and a crash is restarted: a wrong path
used to surface as a restart loop of tracebacks, the real error somewhere among them. The launcher instead checks
here, on its own node, and reports every problem at once, each naming the flag, its value and what is wrong:

- data files: read by the real loader (`actors.data.prompts`), over their first rows only; a recording to
  train on holds its first batch;
- model folders: an existing folder with a `config.json`, or a hub id already in this machine's Hugging Face
  cache (nothing is downloaded here, and several actors downloading at once is no way to fetch a model);
- plugins: every `module:attr` path this node's actors will load is imported and its attribute looked up.

Only what this node's roles read is checked (`ROLE_PLUGINS`): a worker node need not hold the head's data, nor
the learner's Megatron hooks. What only the actor can find it reports with a `ConfigError` (actors.config.errors).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path

from actors.config.engines import engine_spec
from actors.config.run import RunConfig
from actors.config.sections import TRAIN_BACKENDS, WEIGHT_BACKENDS, engine_choices
from actors.config.teachers import Teacher, run_teachers

PREFIX_ROWS = 1000  # rows of a data file read for a usable record (a wrong --input-key shows in the first ones)

# Plugin paths by the roles whose actors load them: field name -> roles.
ROLE_PLUGINS: dict[str, tuple[str, ...]] = {
    "custom_generate_function_path": ("rollout",),
    "rollout_function_path": ("rollout",),
    "rollout_sample_hook_path": ("rollout",),
    "agent_function_path": ("rollout",),
    "agent_tools_path": ("rollout",),
    "agent_environment_path": ("rollout",),
    "agent_tool_schemas_path": ("rollout",),
    "rollout_engine": ("rollout",),
    "weight_transport": ("rollout", "learner"),
    "buffer_filter_path": ("buffer",),
    "custom_reward_post_process_path": ("learner",),
    "custom_advantage_function_path": ("learner",),
    "custom_convert_samples_to_train_data_path": ("learner",),
    "train_backend": ("learner",),
    "custom_megatron_init_path": ("learner",),
    "custom_megatron_before_log_prob_hook_path": ("learner",),
    "custom_megatron_before_train_step_hook_path": ("learner",),
}
BUILTIN_NAMES: dict[str, tuple[str, ...]] = {
    "weight_transport": WEIGHT_BACKENDS,
    # slime's defaults spelled out: they name what the buffer does without a plugin
    "buffer_filter_path": ("slime.rollout.data_source.pop_first",),
}
GPU_TRANSPORTS = ("nccl", "cuda_ipc")
# A Hugging Face hub id: `name` or `owner/name` (what is not a path of more than two parts, nor starts with one).
HUB_ID = re.compile(r"^[A-Za-z0-9_][\w.-]*(/[A-Za-z0-9_][\w.-]*)?$")


def preflight(config: RunConfig, roles: Mapping[str, int], *, hub_cache: Path | None = None) -> list[str]:
    """Every problem found, one line each; empty when all is well. `roles`: role -> its actors on this node.
    `hub_cache`: the Hugging Face hub cache to look a model id up in (default: the one transformers uses)."""
    running = {role for role, count in roles.items() if count > 0}
    return [*_data_problems(config, running), *_model_problems(config, running, hub_cache),
            *_plugin_problems(config, running), *_transport_problems(config, running)]


def _transport_problems(config: RunConfig, running: set[str]) -> list[str]:
    """A GPU-only weight transport on a node without GPUs (slime's scripts say `--update-weight-transport nccl`):
    the learner would fail at its first push and restart into the same failure."""
    transport = config.weights.weight_transport
    if transport not in GPU_TRANSPORTS or not running & {"learner", "rollout"}:
        return []
    from engines.devices import visible_gpus

    if visible_gpus():
        return []
    return [f"--weight-transport {transport}: it moves CUDA tensors, and this node has no GPU (auto picks gloo, or "
            "shared memory when colocated)"]


# ----------------------------------------------------------------------------------------------------- data
def _data_problems(config: RunConfig, running: set[str]) -> list[str]:
    """The buffer reads the training prompts and the eval sets (its eval rounds), the learner a recording."""
    problems = []
    recording = config.learner.load_debug_rollout_data
    if "learner" in running and recording is not None and not (Path(recording) / "batch_000001.msgpack").is_file():
        problems.append(f"--load-debug-rollout-data {recording}: no recorded batch there (batch_000001.msgpack, as "
                        "--save-debug-rollout-data writes)")
    if "buffer" not in running:
        return problems
    data = config.data
    if data.prompt_data is None:
        if not config.learner.load_debug_rollout_data:  # a training-only run trains on its recording
            problems.append("--prompt-data: required (a .jsonl or .parquet file of prompts)")
    else:
        problems += _dataset_problem("--prompt-data", data.prompt_data, config, data.input_key, data.label_key,
                                     data.tool_key)
    for name, path in config.eval.sets.items():
        problems += _dataset_problem(f"--eval-prompt-data {name}", path, config, *config.eval_record_keys,
                                     config.eval_tool_key)
    return problems


def _dataset_problem(flag: str, path: str, config: RunConfig, input_key: str, label_key: str | None,
                     tool_key: str | None) -> list[str]:
    from actors.data.prompts import load_prompts

    try:
        load_prompts(path, input_key=input_key, label_key=label_key, metadata_key=config.data.metadata_key,
                     tool_key=tool_key, chat_template=config.data.apply_chat_template,
                     skip_bad=config.data.skip_bad_data, max_rows=PREFIX_ROWS)
    except OSError as error:
        return [f"{flag} {path}: cannot read it ({error.strerror or error})"]
    except ValueError as error:  # DatasetError, or a Parquet file pyarrow cannot read
        message = str(error)
        return [f"{flag} {message}" if message.startswith(str(path)) else f"{flag} {path}: {message}"]
    return []


# --------------------------------------------------------------------------------------------------- models
def _model_problems(config: RunConfig, running: set[str], hub_cache: Path | None) -> list[str]:
    users = _model_users(config, running)
    if not users:
        return []  # nothing on this node loads the model: it need not be here
    model = config.model
    if model.hf_checkpoint is None:
        return [f"--hf-checkpoint: required: {' and '.join(users)} load the model from it"]
    problems = [_model_folder_problem("--hf-checkpoint", model.hf_checkpoint, hub_cache)]
    if model.ref_checkpoint is not None and "learner" in running and config.policy.needs_ref:
        problems.append(_model_folder_problem("--ref-checkpoint", model.ref_checkpoint, hub_cache))
    if "learner" in running and config.trainer.critic_load is not None and config.policy.needs_critic:
        problems.append(_model_folder_problem("--critic-load", config.trainer.critic_load, hub_cache))
    if "learner" in running:
        problems += [_teacher_folder_problem(teacher, config.distillation.opd_teacher_load, hub_cache)
                     for teacher in run_teachers(config.distillation).values() if teacher.path is not None]
    return [problem for problem in problems if problem is not None]


def _teacher_folder_problem(teacher: Teacher, teacher_load: str | None, hub_cache: Path | None) -> str | None:
    """A teacher the learner loads must be a Hugging Face folder; slime's Megatron checkpoint is named as such."""
    assert teacher.path is not None
    flag = "--opd-teacher-load" if teacher.path == teacher_load else f"--opd-teacher (teacher {teacher.name!r})"
    if (Path(teacher.path).expanduser() / "latest_checkpointed_iteration.txt").is_file():
        return (f"{flag} {teacher.path}: a Megatron checkpoint; the learner's teachers are Hugging Face folders: "
                f"python tools/convert_checkpoint.py megatron-to-hf --hf STUDENT_HF --megatron {teacher.path} "
                "--out TEACHER_HF")
    return _model_folder_problem(flag, teacher.path, hub_cache)


def _model_users(config: RunConfig, running: set[str]) -> list[str]:
    """Who on this node loads --hf-checkpoint, in words."""
    users = []
    if "learner" in running and config.trainer.train_backend in TRAIN_BACKENDS:
        users.append(f"the learner (--train-backend {config.trainer.train_backend})")
    engine = engine_spec(config.engine.rollout_engine)
    if "rollout" in running and engine is not None and engine.loads_checkpoint:
        users.append(f"the rollout workers (--rollout-engine {config.engine.rollout_engine})")
    context = config.rollout.rollout_max_context_len
    counts_tokens = config.data.rollout_max_prompt_len or context or (
        config.eval.eval_max_prompt_len and config.eval.sets)
    if "buffer" in running and counts_tokens:
        users.append("the buffer (its tokenizer measures prompts against the length caps)")
    return users


def _model_folder_problem(flag: str, value: str, hub_cache: Path | None) -> str | None:
    path = Path(value).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return None
        return f"{flag} {value}: the folder has no config.json (not a Hugging Face model folder)"
    if path.exists():
        return f"{flag} {value}: not a directory (expected a Hugging Face model folder)"
    if not HUB_ID.match(value) or "--" in value or ".." in value:
        return f"{flag} {value}: not found: no such directory"
    from huggingface_hub import constants, try_to_load_from_cache

    cache = hub_cache or Path(constants.HF_HUB_CACHE)
    if isinstance(try_to_load_from_cache(value, "config.json", cache_dir=cache), str):
        return None  # a hub id whose files this machine already has: transformers loads them from the cache
    return (f"{flag} {value}: not found: no such directory, and no Hugging Face model {value!r} in this machine's "
            f"cache ({cache}); download it first (huggingface-cli download {value}) or give the model's folder")


# -------------------------------------------------------------------------------------------------- plugins
def _plugin_problems(config: RunConfig, running: set[str]) -> list[str]:
    """Import every plugin path this node's actors will load (the caller puts on sys.path what theirs holds)."""
    settings = {name: value for section in config.model_dump().values() if isinstance(section, dict)
                for name, value in section.items()}
    problems = []
    for name, roles in ROLE_PLUGINS.items():
        if running.isdisjoint(roles):
            continue
        values = settings.get(name)
        for value in values if isinstance(values, list) else [values]:
            if value is not None and value not in (*BUILTIN_NAMES.get(name, ()), *engine_choices(name)):
                problems += _load_problem(f"--{name.replace('_', '-')}", value, _load_path)
    if "buffer" in running and config.buffer.dynamic_sampling_filter_path is not None:
        problems += _load_problem("--dynamic-sampling-filter-path", config.buffer.dynamic_sampling_filter_path,
                                  _load_filter)
    if "reward" in running:
        reward = config.reward
        if reward.custom_rm_path:
            problems += _load_problem("--custom-rm-path", reward.custom_rm_path, _load_path)
        else:
            problems += _load_problem("--rm-type", reward.rm_type,
                                      lambda _flag, name: _build_reward(name, reward.group_rm, reward.rm_url))
    return problems


def _load_problem(flag: str, value: str, load: Callable[[str, str], object]) -> list[str]:
    try:
        load(flag, value)
    except Exception as error:  # a plugin's own import can fail any way: each is a problem to report, not a crash
        message = str(error)
        return [message if message.startswith(flag) else f"{flag} {value}: {message}"]
    return []


def _load_path(flag: str, value: str) -> object:
    from policies.plugins import load_object

    return load_object(value, what=flag)


def _load_filter(flag: str, value: str) -> object:
    from policies.registry import resolve_filter

    return resolve_filter(value)  # a built-in filter's name or a path, as the buffer resolves it


def _build_reward(rm_type: str, group_rm: bool, rm_url: str | None) -> object:
    from policies.rewards.selection import build_reward

    return build_reward(rm_type, group_rm=group_rm, rm_url=rm_url)  # as the reward workers build it
