"""A bad setting, said the way the user gave it: `--max-staleness -1: must be >= 0`, not the config field's path and
pydantic's sentence (`buffer.max_staleness: Input should be greater than or equal to 0`).

A flat setting can come from three places, and the error names the one it came from: a flag (`--max-staleness`),
a key of the `--config` file (`--config run.yaml: buffer.max_staleness`, spelled as the file spells it), or the
head's settings on a worker node. `SettingsError` carries every problem at once, with the valid settings built
into a config (the invalid ones at their defaults) so that the launcher can run its file checks beside them and
report one list before any actor starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from pydantic import ValidationError

from actors.config.run import RunConfig


class SettingsError(ValueError):
    """Every invalid setting, one line each. `usable`: the run's config with those settings left at their defaults,
    for checks that need one (the launcher's preflight reads the data and model paths from it); never run it."""

    def __init__(self, problems: list[str], usable: RunConfig) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems
        self.usable = usable


# pydantic's error types -> how a setting's constraint reads to a user; ctx names the bound.
_CONSTRAINTS = {
    "greater_than_equal": "must be >= {ge}",
    "greater_than": "must be > {gt}",
    "less_than_equal": "must be <= {le}",
    "less_than": "must be < {lt}",
    "int_parsing": "must be a whole number",
    "int_from_float": "must be a whole number",
    "int_type": "must be a whole number",
    "float_parsing": "must be a number",
    "float_type": "must be a number",
    "bool_parsing": "must be true or false",
    "bool_type": "must be true or false",
    "string_type": "must be text",
    "list_type": "must be a list",
    "dict_type": "must be a mapping",
    "literal_error": "must be one of {expected}",
    "extra_forbidden": "unknown setting",
}


def constraint(error: Mapping[str, Any], value: Any) -> str:
    """What one pydantic error says about a value, without the value repeated (a validator's own message often
    starts with it: `'vllm': expected one of torch, sglang, ...`)."""
    template = _CONSTRAINTS.get(error["type"])
    if template is not None:
        try:
            return template.format(**error.get("ctx", {}))
        except KeyError:
            pass
    message = str(error["msg"]).removeprefix("Value error, ").removeprefix("Assertion failed, ")
    return message.removeprefix(f"{value!r}: ").removeprefix(f"{value}: ")


def shown(value: Any) -> str:
    """A value as it would be typed: a flag's list as its words, a string without quotes unless it needs them."""
    if isinstance(value, (list, tuple)):
        return " ".join(shown(item) for item in value)
    if isinstance(value, str):
        return value if value and not any(c.isspace() for c in value) else repr(value)
    return str(value)


class Origin(NamedTuple):
    """Where a setting was given: `where` is "" for a flag, `--config run.yaml` for a key of that file; `spelled`
    is the flag or the key as given (`--max-staleness`, `buffer.max_staleness`)."""

    where: str
    spelled: str


def problem(key: str, value: Any, message: str, origins: Mapping[str, Origin]) -> str:
    """`--flag VALUE: message`, or `--config FILE: key VALUE: message`; a message that names the setting itself
    (`--opd-teacher 'x': expected NAME=SOURCE`) keeps its own words."""
    where, spelled = origins.get(key, Origin("", key))
    prefix = f"{where}: " if where else ""
    if message.startswith(("--" + key.replace("_", "-"), key)):
        return prefix + message
    return f"{prefix}{spelled} {shown(value)}: {message}"


def located_problems(error: ValidationError, values: Mapping[str, Any], origins: Mapping[str, Origin],
                     key_of: Mapping[tuple[str | int, ...], str]) -> tuple[dict[str, str], list[str]]:
    """Split a ValidationError into the problems of single settings (key -> line; the first error of a key, a list's
    items being one setting) and the rest, which concern several settings and name them in their message.
    `key_of`: an error's location (its first one or two parts) -> the flat setting it is about."""
    located: dict[str, str] = {}
    general: list[str] = []
    for item in error.errors():
        loc = tuple(item["loc"])
        key = key_of.get(loc[:2]) or key_of.get(loc[:1])
        if key is not None and key in values:
            located.setdefault(key, problem(key, values[key], constraint(item, values[key]), origins))
        elif key is not None:  # a value no one gave: a rule that set it (a default implied by another setting)
            general.append(problem(key, item.get("input"), constraint(item, item.get("input")), {}))
        else:  # a rule over several settings, which its message names
            general.append(constraint(item, None))
    return located, general
