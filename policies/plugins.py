"""Load a user object named by a dotted path, with errors that say which part failed.

Accepted spellings: ``package.module:attr`` (preferred, unambiguous; ``attr`` may itself be dotted, e.g.
``pkg.mod:Class.method``) and slime's ``package.module.attr`` (the last dotted component is the attribute).
Actors reuse this for every ``--custom-*-path`` flag, so a typo fails at start-up with the module and attribute
named, not deep inside a training step.

Where a module is imported from: the working directory the command was started in, then the installed packages
(``sys.path``). The actors run as ``python -m actors.runtime.main`` in the launcher's working directory, which
puts it first on their path; the launcher and the tools that load plugins (``tools/evaluate.py``) call
``put_working_directory_on_path`` so that they find the same modules.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["PluginError", "is_dotted_path", "load_object", "put_working_directory_on_path"]


class PluginError(ValueError):
    """A dotted path that cannot be imported or does not name the expected object."""


def put_working_directory_on_path() -> None:
    """Import plugins from the working directory first, as the actors do: a command run as a script by its path
    (``python some/dir/script.py``) has its script's folder first on its path instead, and would not find a
    ``my_reward.py`` beside where it was started that a run started there finds."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


def is_dotted_path(name: str) -> bool:
    """True when ``name`` looks like a user path rather than a registered name (registered names have no dots)."""
    return ":" in name or "." in name


def load_object(path: str, *, what: str) -> object:
    """Import ``path`` and return the object it names; ``what`` (e.g. "reward function") prefixes every error."""
    if not isinstance(path, str) or not path.strip():
        raise PluginError(f"{what}: expected a dotted path 'package.module:attr', got {path!r}")
    path = path.strip()
    if ":" in path:
        module_name, _, attr_path = path.partition(":")
    else:
        module_name, _, attr_path = path.rpartition(".")
    if not module_name or not attr_path:
        raise PluginError(f"{what} {path!r}: expected 'package.module:attr' (module and attribute both required)")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import-time failure of user code is reported the same way
        cause = exc.__cause__  # `raise ImportError("X is not installed") from error`: the error says which import
        because = f" (from {type(cause).__name__}: {cause})" if cause is not None else ""
        raise PluginError(
            f"{what} {path!r}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}{because}"
        ) from exc
    obj: object = module
    walked = module_name
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise PluginError(f"{what} {path!r}: {walked!r} has no attribute {part!r}")
        obj = getattr(obj, part)
        walked = f"{walked}.{part}" if walked != module_name else f"{module_name}:{part}"
    return obj


def load_callable(path: str, *, what: str) -> Callable[..., Any]:
    """``load_object`` for a plugin that must be a function (or any callable): a data object is refused by name."""
    obj = load_object(path, what=what)
    if not callable(obj):
        raise TypeError(f"{what} {path!r}: {type(obj).__name__} is not callable")
    return obj
