"""Modules that moved, still importable from where they were, with a warning that names their new place.

A plugin written against `actors.rollout_generate` keeps working after that module became
`actors.rollout.generate`; its user sees, once, a `FutureWarning` saying where it went and that `actors.plugins`
is the module that stays put. The finder sits last on `sys.meta_path`, so it only answers names that exist nowhere
else: a module that comes back under an old name is imported as itself. When a module moves, its old name goes in
`MOVED` with the new one (renaming an entry that is already here to the newest place).

The old names expire: from `OLD_NAMES_END` on, importing one fails with an ImportError that names the new place,
so a plugin that never moved learns it at once, and the shim can then be deleted. Each warning gives the date.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from datetime import date
from types import ModuleType
from typing import Any

MOVED: dict[str, str] = {
    "actors.base": "actors.runtime.base",
    "actors.buffer.eval_ids": "actors.evaluator.ids",
    "actors.buffer.prompt_data": "actors.data.prompts",
    "actors.buffer_core": "actors.buffer.core",
    "actors.buffer_log": "actors.buffer.log",
    "actors.context": "actors.runtime.context",
    "actors.controller.eval_rounds": "actors.evaluator.rounds",
    "actors.engine_factory": "actors.rollout.engine_factory",
    "actors.eval_rounds": "actors.evaluator.rounds",
    "actors.handlers": "actors.runtime.handlers",
    "actors.learner.checkpoint_pointer": "actors.runtime.checkpoint_pointer",
    "actors.learner_ranks": "actors.learner.ranks",
    "actors.learner_step": "actors.learner.step",
    "actors.logs": "actors.runtime.logs",
    "actors.main": "actors.runtime.main",
    "actors.metrics": "actors.runtime.metrics",
    "actors.peers": "actors.runtime.peers",
    "actors.placement": "actors.launch.placement",
    "actors.progress": "actors.report.progress",
    "actors.prompt_data": "actors.data.prompts",
    "actors.roles": "actors.runtime.roles",
    "actors.rollout.prompt_tokens": "actors.data.prompt_tokens",
    "actors.rollout_generate": "actors.rollout.generate",
    "actors.supervisor": "actors.launch.supervisor",
    "actors.trainer_factory": "actors.learner.trainer_factory",
    "actors.wandb_mirror": "actors.controller.wandb_mirror",
    "engines.sglang.server": "tools.standins.sglang_server.server",
    "engines.tiny_model": "tools.standins.tiny_model",
}
OLD_NAMES_END = date(2027, 3, 1)  # three months after `actors.plugins` became the surface that stays put


def _today() -> date:
    return date.today()


# `--sglang-server-module` names a module to run, not to import: the config maps these old names itself.
MOVED_SERVER_MODULES: dict[str, str] = {"engines.sglang.server": "tools.standins.sglang_server"}


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old name as a module that forwards every attribute to the module's new place."""

    def find_spec(self, fullname: str, path: Any = None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default: a plain module, filled in by exec_module

    def exec_module(self, module: ModuleType) -> None:
        new_name = MOVED[module.__name__]
        where = f"import from {new_name}, or from actors.plugins, the module plugins import that stays put"
        if _today() >= OLD_NAMES_END:
            raise ImportError(f"{module.__name__} moved to {new_name}, and its old name stopped importing on "
                              f"{OLD_NAMES_END.isoformat()}: {where}", name=module.__name__)
        warnings.warn(f"{module.__name__} moved to {new_name}: {where}; the old name stops importing on "
                      f"{OLD_NAMES_END.isoformat()}", FutureWarning, stacklevel=2)
        new = importlib.import_module(new_name)
        module.__getattr__ = lambda name: getattr(new, name)  # type: ignore[method-assign]
        module.__dir__ = lambda: dir(new)  # type: ignore[method-assign]
        if hasattr(new, "__all__"):
            module.__all__ = new.__all__
        module.__doc__ = f"Moved to {new_name}."


def install() -> None:
    """Once per process (importing `actors` does it)."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
