"""What the launcher checks before any actor starts: the settings that can be checked in a second or two.

An actor finds a bad setting only when it uses it, after its start-up, and a crash is restarted: a wrong path
used to surface as a restart loop of tracebacks, the real error somewhere among them. The launcher instead checks
here, on its own node, and reports every problem at once, each naming the flag, its value and what is wrong:

- data files: read by the real loader (`actors.data.prompts`), over their first rows only; a recording to
  train on holds its first batch;
- model folders: an existing folder with a `config.json`, or a hub id already in this machine's Hugging Face
  cache (nothing is downloaded here, and several actors downloading at once is no way to fetch a model);
- plugins: every `module:attr` path this node's actors will load is imported and its attribute looked up.

Only what this node's roles read is checked (`ROLE_PLUGINS`, from the `plugin_for` mark on each plugin setting's
field): a worker node need not hold the head's data, nor the learner's Megatron hooks. What only the actor can
find it reports with a `ConfigError` (actors.config.errors).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from actors.config.engines import engine_spec, train_backend_spec
from actors.config.plugin_marks import PLUGIN_FOR
from actors.config.profiling import memory_recorder_problem
from actors.config.rollout_fp8 import rollout_fp8_problems, rolls_out_fp8
from actors.config.run import RunConfig, policy_run_config
from actors.config.teachers import Teacher, run_teachers
from policies.registry import BuiltinNames

PREFIX_ROWS = 1000  # rows of a data file read for a usable record (a wrong --input-key shows in the first ones)



def plugin_marks() -> dict[str, dict[str, Any]]:
    """Every plugin setting's mark (`actors.config.sections.plugin_for`, on its field): setting -> mark."""
    marks = {}
    for section in RunConfig.model_fields.values():
        model = section.annotation
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            continue
        for name, field in model.model_fields.items():
            if isinstance(field.json_schema_extra, dict) and PLUGIN_FOR in field.json_schema_extra:
                marks[name] = {**field.json_schema_extra, "builtins": (*field.json_schema_extra["builtins"],
                                                                      *_builtin_names(field.metadata))}
    return marks


def _builtin_names(metadata: list[Any]) -> tuple[str, ...]:
    return tuple(name for item in metadata if isinstance(item, BuiltinNames) for name in item.names())


# Plugin settings by the roles whose actors load them: setting -> roles, as their fields are marked.
ROLE_PLUGINS: dict[str, tuple[str, ...]] = {name: mark[PLUGIN_FOR] for name, mark in plugin_marks().items()}
GPU_TRANSPORTS = ("nccl", "cuda_ipc")
# A Hugging Face hub id: `name` or `owner/name` (what is not a path of more than two parts, nor starts with one).
HUB_ID = re.compile(r"^[A-Za-z0-9_][\w.-]*(/[A-Za-z0-9_][\w.-]*)?$")


def preflight(config: RunConfig, roles: Mapping[str, int], *, hub_cache: Path | None = None) -> list[str]:
    """Every problem found, one line each; empty when all is well. `roles`: role -> its actors on this node.
    `hub_cache`: the Hugging Face hub cache to look a model id up in (default: the one transformers uses).

    In a run of several policies every check runs on each policy's settings (the shared roles serve each policy
    with its own: its reward, its sampling), and a problem is named by its policy ("policies.solver: --prompt-data
    ..."), unless every policy has it: then it is the run's, said once."""
    running = {role for role, count in roles.items() if count > 0}
    if not config.policies:
        alone = [f"own_engines {config.engine.own_engines}: a setting of a policy in a run of several "
                 "(policies.NAME.own_engines); a run of one policy generates on engines of its own already"]
        return [*alone * bool(config.engine.own_engines), *_problems(config, running, hub_cache)]
    own_configs = {name: policy_run_config(config, name) for name in config.policies}
    found = {name: _problems(own, running, hub_cache) for name, own in own_configs.items()}
    everyone = [problem for problem in next(iter(found.values())) if all(problem in own for own in found.values())]
    return [*everyone, *(f"policies.{name}: {problem}" for name, own in found.items() for problem in own
                         if problem not in everyone),
            *(_shared_save_problems(own_configs) if "learner" in running else [])]


def _shared_save_problems(configs: Mapping[str, RunConfig]) -> list[str]:
    """Two policies' learners saving into one folder would overwrite each other's checkpoints and `latest`, and a
    resumed run would load one policy's adapter into the other; by default each saves in its own run directory."""
    savers: dict[str, list[str]] = {}
    for name, config in configs.items():
        if config.learner.save is not None:
            savers.setdefault(str(Path(config.learner.save).expanduser().resolve()), []).append(name)
    return [f"--save {folder}: policies {', '.join(names)} would save their checkpoints in the same folder; give "
            f"each its own (policies.<name>.save) or leave --save out (each saves in RUN_DIR/policies/<name>)"
            for folder, names in savers.items() if len(names) > 1]


def _problems(config: RunConfig, running: set[str], hub_cache: Path | None) -> list[str]:
    return [*_data_problems(config, running), *_model_problems(config, running, hub_cache),
            *_plugin_problems(config, running), *_transport_problems(config, running),
            *_profiling_problems(config, running), *_fp8_shape_problems(config, running),
            *_implied_fp8_problems(config)]


def _implied_fp8_problems(config: RunConfig) -> list[str]:
    """An FP8 --hf-checkpoint rolls out in FP8 without --rollout-fp8 (`rolls_out_fp8`), so the run must be one that
    can: checked here, where the folder is read, with what --rollout-fp8 itself is checked against."""
    weights = config.weights
    if weights.rollout_fp8 or not rolls_out_fp8(weights, config.model.hf_checkpoint):
        return []
    implied = weights.model_copy(update={"rollout_fp8": True})
    return [f"--hf-checkpoint {config.model.hf_checkpoint} is an FP8 checkpoint, so the run rolls out in FP8: "
            + problem.removeprefix("--rollout-fp8: ")
            for problem in rollout_fp8_problems(implied, config.engine, lora=config.lora.enabled)]


def _fp8_shape_problems(config: RunConfig, running: set[str]) -> list[str]:
    """--rollout-fp8 on an engine that serves FP8 in whole tiles only (SGLang): the projections of --hf-checkpoint
    it would refuse, found before its servers are started on a conversion of it. (An attached server was started
    already; the rollout worker checks what it serves.)"""
    spec = engine_spec(config.engine.rollout_engine)
    checkpoint, engine = config.model.hf_checkpoint, config.engine
    attached = spec is not None and spec.attaches and (engine.sglang_url or engine.sglang_router_url)
    if (not rolls_out_fp8(config.weights, checkpoint) or "rollout" not in running or spec is None
            or spec.fp8_shape_check is None or attached or checkpoint is None):
        return []
    config_file = Path(checkpoint).expanduser() / "config.json"
    if not config_file.is_file():
        return []  # a hub id: the rollout worker checks it at its start
    from policies.plugins import load_object

    check = load_object(spec.fp8_shape_check, what="fp8_shape_check")
    return list(check(json.loads(config_file.read_text()), config.engine.rollout_num_gpus_per_engine,
                      f"--rollout-fp8 --hf-checkpoint {checkpoint}"))


def _profiling_problems(config: RunConfig, running: set[str]) -> list[str]:
    """A memory recorder where what it records cannot exist (CUDA's allocator on a node without a GPU, memray
    without the package): the learner would fail at its start and restart into the same failure."""
    if "learner" not in running:
        return []
    problem = memory_recorder_problem(config.profiling)
    return [problem] if problem is not None else []


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
    if "learner" in running and recording is not None:
        problems += _recording_problem(recording)
    if "buffer" not in running:
        return problems
    data = config.data
    if not config.source.reads_prompt_data:
        pass  # a source of the user's reads what it likes (args.prompt_data too), or nothing is read
    elif data.prompt_data is None:
        if not config.learner.load_debug_rollout_data:  # a training-only run trains on its recording
            problems.append("--prompt-data: required (a .jsonl or .parquet file of prompts)")
    else:
        problems += _dataset_problem("--prompt-data", data.prompt_data, config, data.input_key, data.label_key,
                                     data.tool_key)
    for name, path in config.eval.sets.items():
        own = config.for_eval_set(name)  # a set's own record keys (--eval-config)
        problems += _dataset_problem(f"--eval-prompt-data {name}", path, config, *own.eval_record_keys,
                                     own.eval_tool_key)
    return problems


def _recording_problem(recording: str) -> list[str]:
    """A folder of our recorded batches, or slime's rollout dumps: a file, or a {rollout_id} template (its batch-1
    file, or the 0 file every batch falls back to, `actors.slime_compat.forge`)."""
    if "{rollout_id}" not in recording and not recording.endswith(".pt") and not Path(recording).is_file():
        if (Path(recording) / "batch_000001.msgpack").is_file():
            return []
        return [f"--load-debug-rollout-data {recording}: no recorded batch there (batch_000001.msgpack, as "
                "--save-debug-rollout-data writes)"]
    try:
        first = Path(recording.format(rollout_id=0)) if "{rollout_id}" in recording else Path(recording)
    except (KeyError, IndexError, ValueError) as error:
        return [f"--load-debug-rollout-data {recording}: the only placeholder is {{rollout_id}} ({error!r})"]
    if first.is_file():
        return []
    return [f"--load-debug-rollout-data {recording}: no rollout dump {first} (slime's --load-forge-rollout-data "
            "file, or a {rollout_id} template's 0 file)"]


def _dataset_problem(flag: str, path: str, config: RunConfig, input_key: str, label_key: str | None,
                     tool_key: str | None) -> list[str]:
    from actors.data.prompts import image_field, load_prompts

    try:
        load_prompts(path, input_key=input_key, label_key=label_key, metadata_key=config.data.metadata_key,
                     tool_key=tool_key, chat_template=config.data.apply_chat_template,
                     skip_bad=config.data.skip_bad_data, max_rows=PREFIX_ROWS, image_field=image_field(config.data))
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
    if "learner" in running:
        problems.append(_vision_backend_problem(config))
    if model.ref_checkpoint is not None and "learner" in running and config.policy.needs_ref:
        problems.append(_model_folder_problem("--ref-checkpoint", model.ref_checkpoint, hub_cache))
    if "learner" in running and config.trainer.critic_load is not None and config.policy.needs_critic:
        problems.append(_model_folder_problem("--critic-load", config.trainer.critic_load, hub_cache))
    if "learner" in running:
        problems += [_teacher_folder_problem(teacher, config.distillation.opd_teacher_load, hub_cache)
                     for teacher in run_teachers(config.distillation).values() if teacher.path is not None]
    return [problem for problem in problems if problem is not None]


def _vision_backend_problem(config: RunConfig) -> str | None:
    """A vision-language model (a local folder whose config has a vision tower) on a backend that cannot train one."""
    spec = train_backend_spec(config.trainer.train_backend)
    assert config.model.hf_checkpoint is not None
    config_file = Path(config.model.hf_checkpoint).expanduser() / "config.json"
    if spec is None or spec.no_images_because is None or not config_file.is_file():
        return None
    from engines.checkpoint_config import is_vision_language

    if not is_vision_language(json.loads(config_file.read_text())):
        return None
    return (f"--train-backend {config.trainer.train_backend}: {config.model.hf_checkpoint} is a vision-language "
            f"model, which this backend cannot train: {spec.no_images_because}")


MEGATRON_LATEST = "latest_checkpointed_iteration.txt"  # beside a Megatron checkpoint's iter_NNNNNNN folders


def _teacher_folder_problem(teacher: Teacher, teacher_load: str | None, hub_cache: Path | None) -> str | None:
    """A teacher the learner loads must be a Hugging Face folder; slime's Megatron checkpoint is named as such."""
    assert teacher.path is not None
    flag = "--opd-teacher-load" if teacher.path == teacher_load else f"--opd-teacher (teacher {teacher.name!r})"
    folder = Path(teacher.path).expanduser()
    if any((where / MEGATRON_LATEST).is_file() for where in (folder, folder.parent)):  # a folder, or one iteration
        return (f"{flag} {teacher.path}: a Megatron checkpoint; the learner's teachers are Hugging Face folders: "
                f"python -m tools.convert_checkpoint megatron-to-hf --hf STUDENT_HF --megatron {teacher.path} "
                "--out TEACHER_HF")
    return _model_folder_problem(flag, teacher.path, hub_cache)


def _model_users(config: RunConfig, running: set[str]) -> list[str]:
    """Who on this node loads --hf-checkpoint, in words."""
    users = []
    if "learner" in running and train_backend_spec(config.trainer.train_backend) is not None:
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
    """Import every plugin path this node's actors will load (the caller puts on sys.path what theirs holds); a
    setting its role builds from a name or a path (a reward, a filter) is built by that role's own builder."""
    settings = {name: value for section in config.model_dump().values() if isinstance(section, dict)
                for name, value in section.items()}
    problems = []
    builders: dict[str, str] = {}  # builder -> the flag of the last of its settings that is set
    for name, mark in plugin_marks().items():
        if running.isdisjoint(mark[PLUGIN_FOR]):
            continue
        values = settings.get(name)
        if mark["builder"] is not None:
            if values is not None or mark["builder"] not in builders:
                builders[mark["builder"]] = name
            continue
        for value in values if isinstance(values, list) else [values]:
            if value is not None and value not in mark["builtins"]:
                problems += _load_problem(_flag(name), value, _load_path)
    for builder, name in builders.items():
        problems += _load_problem(_flag(name), settings[name], partial(_build, builder, config))
    for name in config.eval.eval_set_settings if "reward" in running else ():  # a set's own reward
        own = config.for_eval_set(name)
        if own.reward != config.reward:
            problems += [f"eval set {name!r}: {problem}" for problem in _load_problem(
                "--rm-type", own.reward.custom_rm_path or own.reward.rm_type, partial(_build, "reward_spec", own))]
    return problems


def _flag(setting: str) -> str:
    return f"--{setting.replace('_', '-')}"


def _load_problem(flag: str, value: object, load: Callable[[str, Any], object]) -> list[str]:
    try:
        load(flag, value)
    except Exception as error:  # a plugin's own import can fail any way: each is a problem to report, not a crash
        message = str(error)
        if message.startswith(flag):
            return [message]
        named = f"{value!r}: "  # a builder's message that names the value by its own noun: the flag names it here
        return [f"{flag} {message[message.index(named):]}" if named in message else f"{flag} {value}: {message}"]
    return []


def _load_path(flag: str, value: str) -> object:
    from policies.plugins import load_object

    return load_object(value, what=flag)


def _build(builder: str, config: RunConfig, _flag: str, _value: object) -> object:
    """What the role builds from its settings, built as it does (`actors.extensions.load`)."""
    from actors.extensions import load

    return getattr(load, builder)(config)
