"""Flat slime-style flags and YAML keys <-> the sectioned `RunConfig`.

Flags follow slime's names (`--rollout-batch-size`, `--n-samples-per-prompt`, `--eps-clip-high`, ...). A YAML
file (`--config run.yaml`) sets any field, either flat (`lr: 1e-5`, as on the command line) or by section
(`trainer: {lr: 1e-5}`, as in the `config.yaml` a run writes); flags override the file; an unknown key or flag is
an error that names it. `--help-all` lists the flags grouped by the section that owns them (`--help`, a first
run's: `actors/config/help.py`).
"""

from __future__ import annotations

import argparse
import inspect
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ValidationError

from actors.config.flag_parser import near_name_hints
from actors.config.run import OWNER, SECTIONS, RunConfig
from actors.config.sections import JSON_FLAG
from actors.config.settings_errors import Origin, SettingsError, located_problems
from actors.config.slime_flags import POLICY_SWITCHES, SPELLED_AS, add_slime_flags, apply_slime_flags, policy_settings
from actors.config.slime_table import SLIME_FLAGS
from policies.config import PolicyLossConfig
from policies.registry import BuiltinNames

RUN_WIDE = ("seed", "torch_threads", "policies", "custom_config")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _unwrap_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, grouped by section; defaults stay None so only flags given on the command line
    override the YAML file."""
    settings = parser.add_argument_group("settings", "Every setting below is also a --config YAML key.")
    settings.add_argument("--config", type=Path, default=None, metavar="PATH", help="YAML file of run settings "
                          "(snake_case keys, flat or by section)")
    _add_model_flags(settings, {name: RunConfig.model_fields[name] for name in RUN_WIDE})
    for section, model in SECTIONS.items():
        group = parser.add_argument_group(f"{section} settings", summary(model.__doc__))
        _add_model_flags(group, dict(model.model_fields))
    algorithm = parser.add_argument_group("policy settings", summary(PolicyLossConfig.__doc__))
    _add_model_flags(algorithm, dict(PolicyLossConfig.model_fields))
    for name, (_, help_text) in POLICY_SWITCHES.items():
        algorithm.add_argument(_flag(name), dest=name, action="store_true", default=None, help=help_text)
    add_slime_flags(parser)  # last: only slime's flags that no section defines


def summary(doc: str | None) -> str:
    """A docstring's first paragraph, as one line: what a help group says about itself."""
    paragraph = inspect.cleandoc(doc or "").split("\n\n", 1)[0]
    return " ".join(paragraph.split())


def _metavar(name: str, annotation: Any, names: BuiltinNames | None) -> str:
    """A short placeholder (N, X, NAME, PATH, VALUE): the flag and its help then share a line where they fit."""
    if names is not None:
        return "NAME"
    if annotation is int:
        return "N"
    if annotation is float:
        return "X"
    if name.endswith(("_path", "_data", "_checkpoint", "_load", "_dir")) or name in ("save", "load"):
        return "PATH"
    return "VALUE"


def _add_model_flags(group: Any, fields: dict[str, Any]) -> None:
    for name, field in fields.items():
        annotation = _unwrap_optional(field.annotation)
        default = field.default if field.default_factory is None else field.default_factory()
        names = next((item for item in field.metadata if isinstance(item, BuiltinNames)), None)
        help_text = (field.description or "").replace("%", "%%")
        if names is not None:  # expanded when help is shown (argparse fills %(attr)s from the action)
            help_text += "; one of %(builtin_names)s"
        if default not in (None, [], {}) and "(default:" not in help_text:
            help_text += f" (default: {default})"
        json_flag = isinstance(field.json_schema_extra, dict) and field.json_schema_extra.get(JSON_FLAG)
        if typing.get_origin(annotation) is dict and not json_flag:
            continue  # set in YAML, or by a pass-through flag family (see split_sglang_args)
        if json_flag:  # a JSON object on the command line (slime's spelling); the section's validator reads it
            action = group.add_argument(_flag(name), dest=name, type=str, default=None, help=help_text,
                                        metavar="JSON")
        elif annotation is bool and name.startswith("no_"):
            # A negative switch of Megatron's (--no-rope-fusion): BooleanOptionalAction would read the name's own
            # "--no-" as its negation and store False.
            action = group.add_argument(_flag(name), dest=name, action="store_true", default=None, help=help_text)
        elif annotation is bool:
            action = group.add_argument(_flag(name), dest=name, action=argparse.BooleanOptionalAction, default=None,
                                        help=help_text)
        elif typing.get_origin(annotation) is list:
            item = (typing.get_args(annotation) or (str,))[0]
            action = group.add_argument(_flag(name), dest=name, nargs="*", default=None, help=help_text,
                                        metavar="N" if item is int else "VALUE")
        elif typing.get_origin(annotation) is Literal:
            action = group.add_argument(_flag(name), dest=name, choices=typing.get_args(annotation), default=None,
                                        help=help_text)
        else:
            kind = annotation if annotation in (int, float) else str
            action = group.add_argument(_flag(name), dest=name, type=kind, default=None, help=help_text,
                                        metavar=_metavar(name, kind, names))
        action.builtin_names = names


def config_from_args(args: argparse.Namespace, *, base: dict[str, Any] | None = None) -> RunConfig:
    """`base` first (a worker node's: the head's settings, by section as RUN_DIR/config.yaml holds them), then the
    YAML file, then every flag the user gave. A bad setting raises SettingsError with every problem at once, each
    naming the flag, or the file and key, that gave it and the value given.

    slime's flags are first rewritten into ours; the environment and start-up note they imply are left on
    `args.slime_translation` for the launcher."""
    args.slime_translation = apply_slime_flags(args)
    values: dict[str, Any] = {}
    origins: dict[str, Origin] = {}
    problems: list[str] = []
    sources = [("the head's settings", base)]
    if args.config is not None:
        sources.append((f"--config {args.config}", _read_yaml(args.config)))
    for where, loaded in sources:
        if loaded is not None:
            flat, spelled, unknown = _flatten(loaded, source=where)
            values.update(flat)
            origins.update({key: Origin(where, spelled[key]) for key in flat})
            problems += unknown
    spelled_as = getattr(args, SPELLED_AS, {})
    for name in _flat_keys():
        given = getattr(args, name, None)
        if given is not None:
            values[name] = given
            origins[name] = Origin("", spelled_as.get(name, _flag(name)))
    passed_through = getattr(args, "sglang_passthrough", None)
    if passed_through:
        values["sglang_args"] = {**values.get("sglang_args", {}), **passed_through}
    try:
        config = build_config(values, origins=origins)
    except SettingsError as error:
        raise SettingsError(problems + error.problems, error.usable) from None
    if problems:
        raise SettingsError(problems, config)
    if config.sft.num_epoch is not None and "num_rollout" not in values:
        values["num_rollout"] = config.sft.num_epoch * _batches_per_epoch(config)
        config = build_config(values, origins=origins)
    unread = config.engine.sglang_args_without_effect()
    if unread:
        args.slime_translation.notes.append(
            f"{', '.join('--sglang-' + name for name in unread)} (SGLang server arguments; the rollout engine is "
            f"{config.engine.rollout_engine}: they reach SGLang servers with --rollout-engine sglang)")
    return config


def _batches_per_epoch(config: RunConfig) -> int:
    """slime's num_rollout per epoch: the whole batches in the prompts the buffer will keep."""
    from actors.data.prompt_tokens import batches_per_epoch

    try:
        batches = batches_per_epoch(config)
    except (OSError, ValueError) as error:  # no --prompt-data, a file that cannot be read
        raise SettingsError([f"--num-epoch {config.sft.num_epoch} counts --prompt-data's records: {error}"],
                            config) from None
    if batches == 0:
        raise SettingsError([f"--num-epoch {config.sft.num_epoch}: {config.data.prompt_data} holds fewer usable "
                             f"records than one batch (--rollout-batch-size {config.rollout.rollout_batch_size})"],
                            config)
    return batches


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"--config {path}: {error}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"--config {path}: expected a mapping of settings, got {type(loaded).__name__}")
    return loaded


def _flatten(loaded: dict[str, Any], *, source: str) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """Section mappings (`trainer: {lr: ...}`, `policy: {...}`) become flat keys; flat keys pass as they are.
    Returns the known settings, how the file spells each (`trainer.lr`), and a problem per unknown key, which is
    left out; `source` names where they come from in errors ("--config run.yaml")."""
    flat: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    problems: list[str] = []
    for key, value in loaded.items():
        if key in (*SECTIONS, "policy") and isinstance(value, dict):
            fields = PolicyLossConfig.model_fields if key == "policy" else SECTIONS[key].model_fields
            strays = sorted(set(value) - set(fields))
            if strays:
                problems.append(f"{source}: unknown key(s) in section {key!r}: {', '.join(strays)}"
                                + _hints(strays, list(fields)))
            flat.update({name: item for name, item in value.items() if name in fields})
            spelled.update({name: f"{key}.{name}" for name in value if name in fields})
        else:
            flat[key] = value
            spelled[key] = key
    unknown = sorted(set(flat) - _flat_keys())
    if unknown:
        problems.append(f"{source}: unknown key(s) {', '.join(unknown)}" + _hints(unknown, sorted(_flat_keys())))
    known = {key: value for key, value in flat.items() if key not in unknown}
    return known, spelled, problems


def _hints(unknown: list[str], known: list[str]) -> str:
    hints = near_name_hints(unknown, known)
    return f" ({'; '.join(hints)})" if hints else ""


SGLANG_PREFIX = "--sglang-"


def split_sglang_args(argv: list[str]) -> tuple[list[str], dict[str, str | list[str]]]:
    """Take `--sglang-NAME VALUE` (or `--sglang-NAME=VALUE`, or a bare switch) out of argv for the SGLang server.

    SGLang has hundreds of server arguments; forwarding a prefixed family keeps them out of our flag list while
    letting a user set any of them. A bare switch is forwarded as the value "true". Our own `sglang_*` settings
    (`--sglang-url`, `--sglang-server-module`, ...) stay in argv for the ordinary flag parser.
    """
    rest: list[str] = []
    found: dict[str, str | list[str]] = {}
    index = 0
    while index < len(argv):
        token = argv[index]
        name, has_value, text = token[len(SGLANG_PREFIX):].partition("=")
        value: str | list[str] = text
        # --sglang-url etc. are ours; --sglang-router-ip, --sglang-config etc. are slime's own, not the server's
        own_setting = "sglang_" + name.replace("-", "_") in OWNER or SGLANG_PREFIX + name in SLIME_FLAGS
        if not token.startswith(SGLANG_PREFIX) or token == SGLANG_PREFIX or own_setting:
            rest.append(token)
            index += 1
            continue
        if not has_value:
            values = []  # SGLang's list flags (--cuda-graph-bs 1 2 4) take every value up to the next flag
            while index + 1 < len(argv) and not argv[index + 1].startswith("--"):
                values.append(argv[index + 1])
                index += 1
            value = (values[0] if len(values) == 1 else values) if values else "true"
        found[name.replace("_", "-")] = value
        index += 1
    return rest, found


def _flat_keys() -> set[str]:
    return set(OWNER) | set(RUN_WIDE) | set(PolicyLossConfig.model_fields) | set(POLICY_SWITCHES)


# Where a ValidationError points (its location's first parts) -> the flat setting it is about.
_RUN_KEYS: dict[tuple[str | int, ...], str] = {
    **{(section, name): name for section, model in SECTIONS.items() for name in model.model_fields},
    **{(name,): name for name in RUN_WIDE}}


def build_config(values: dict[str, Any], *, origins: Mapping[str, Origin] | None = None) -> RunConfig:
    """Flat settings (run and algorithm keys mixed, as in YAML and flags) -> a validated RunConfig.

    Raises SettingsError with every problem: each invalid value is named as `origins` says it was given (default:
    by its key) and then left out, and the rest validated again, since the rules that tie settings together run
    only once each setting is valid; so one pass finds what a user would otherwise meet one rerun at a time."""
    origins = origins or {}
    problems: list[str] = []
    kept = dict(values)
    while True:
        config, usable, located, general = _validated(kept, origins)
        problems += [line for line in [*located.values(), *general] if line not in problems]
        if config is not None or not located:
            break
        for key in located:
            del kept[key]
    if config is not None and not problems:
        return config
    raise SettingsError(problems, config or usable or _sections_alone(kept))


def _validated(values: dict[str, Any], origins: Mapping[str, Origin],
               ) -> tuple[RunConfig | None, RunConfig | None, dict[str, str], list[str]]:
    """(the config or None, a config of the run settings with the default policy when only the policy failed,
    the problems of single settings by key, the other problems)."""
    policy_keys = set(PolicyLossConfig.model_fields) | set(POLICY_SWITCHES)
    given = {k: v for k, v in values.items() if k in policy_keys}
    located: dict[str, str] = {}
    general: list[str] = []
    policy = None
    try:
        policy = PolicyLossConfig(**policy_settings(given))
    except ValidationError as error:
        located, general = located_problems(error, values, origins,
                                            {(name,): name for name in PolicyLossConfig.model_fields})
    except ValueError as error:
        general.append(str(error))
    run_values = {k: v for k, v in values.items() if k not in policy_keys}
    try:
        run = RunConfig(**run_values, **({"policy": policy} if policy is not None else {}))
    except ValidationError as error:
        more_located, more_general = located_problems(error, values, origins, _RUN_KEYS)
        return None, None, {**located, **more_located}, general + more_general
    return (run if policy is not None else None), run, located, general


def _sections_alone(values: dict[str, Any]) -> RunConfig:
    """When rules that tie settings together fail: each section of the valid settings on its own (one that fails
    alone at its defaults), for the checks that read a section at a time (the launcher's file checks)."""
    sections = {}
    for name, model in SECTIONS.items():
        try:
            sections[name] = model(**{key: value for key, value in values.items() if OWNER.get(key) == name})
        except ValidationError:
            sections[name] = model()
    return RunConfig.model_construct(**sections, **{key: values[key] for key in RUN_WIDE if key in values})


def write_effective_config(config: RunConfig, run_dir: Path, *, name: str = "config.yaml") -> Path:
    path = run_dir / name
    path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), encoding="utf-8")
    return path
