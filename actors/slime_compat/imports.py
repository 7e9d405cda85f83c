"""``import slime.utils.types`` and friends answered with our own equivalents, so slime's plugins load unchanged.

slime's example plugins are modules of its checkout written against slime's own modules (``from slime.utils.types
import Sample``, ``from slime.rollout.rm_hub import batched_async_rm`` ...). A meta-path finder, installed by
importing `actors` (next to `actors.moved`'s), answers those names with module objects that hold exactly the
names slime's plugins use, each one ours (`OFFERED`). It never stands in for slime itself: it sits last on
``sys.meta_path`` and steps aside whenever another finder can import ``slime`` (a pip-installed slime, or a checkout
on the path), decided at each import, not once; and it answers a ``slime.X`` only below its own ``slime``.

A ``slime.X`` not offered fails with a ModuleNotFoundError that names X, says why where we know (`MISSING`) and
lists what is offered; a name not offered in an offered module fails the same way (an ImportError: ``from
slime.utils.misc import exec_command`` says which names slime.utils.misc has here). The other packages slime's
examples import (`PACKAGES`) are never answered: where one is not installed (no finder before ours found it), its
import fails with what it is and how to get it, instead of Python's bare "No module named".
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Any

__all__ = ["MISSING", "OFFERED", "PACKAGES", "SlimeImportFinder", "install", "offered_modules"]

ROOT = "slime"
DOC = 'docs/slime.md "Plugins"'

# slime's module -> {name a plugin imports: "our_module:attr"}; a package's submodules are its other entries.
OFFERED: dict[str, dict[str, str]] = {
    "slime": {},
    "slime.utils": {},
    "slime.utils.types": {"Sample": "actors.slime_compat.sample:Sample"},
    "slime.utils.http_utils": {"post": "actors.slime_compat.http:post", "get": "actors.slime_compat.http:get"},
    "slime.utils.misc": {"load_function": "actors.slime_compat.misc:load_function",
                         "SingletonMeta": "actors.slime_compat.misc:SingletonMeta"},
    "slime.utils.processing_utils": {"load_tokenizer": "actors.slime_compat.state:load_tokenizer"},
    "slime.utils.async_utils": {"run": "actors.slime_compat.async_loop:run"},
    "slime.rollout": {},
    "slime.rollout.sglang_rollout": {"GenerateState": "actors.slime_compat.state:GenerateState"},
    "slime.rollout.rm_hub": {"async_rm": "actors.slime_compat.rm_hub:async_rm",
                             "batched_async_rm": "actors.slime_compat.rm_hub:batched_async_rm"},
    "slime.rollout.rm_hub.math_dapo_utils": {
        "compute_score": "actors.slime_compat.rm_hub:compute_score",
        "normalize_final_answer": "policies.rewards.dapo:normalise_final_answer"},
    "slime.rollout.base_types": {"RolloutFnTrainOutput": "actors.slime_compat.rollout_function:RolloutFnTrainOutput",
                                 "RolloutFnEvalOutput": "actors.slime_compat.rollout_function:RolloutFnEvalOutput"},
    "slime.rollout.data_source": {"DataSource": "actors.slime_compat.prompt_source:DataSource",
                                  "pop_first": "actors.slime_compat.data_source:pop_first"},
    "slime.rollout.filter_hub": {},
    "slime.rollout.filter_hub.base_types": {"DynamicFilterOutput": "actors.slime_compat.plugins:DynamicFilterOutput"},
    "slime.backends": {},
    "slime.backends.megatron_utils": {},
    "slime.backends.megatron_utils.cp_utils": {
        "all_gather_with_cp": "actors.slime_compat.context_parallel:all_gather_with_cp",
        "slice_log_prob_with_cp": "actors.slime_compat.context_parallel:slice_log_prob_with_cp"},
}

# Modules slime's examples import that are not offered, and why (the module or any of its submodules).
MISSING: dict[str, str] = {
    "slime.agent": "slime's coding-agent harnesses (slime.agent: sandbox, harness, adapters) run Claude Code or "
                   "Codex inside E2B cloud sandboxes: the e2b package, an E2B_API_KEY, sandboxes that reach back to "
                   "this host, and Node and CLI tarballs uploaded into each. That is slime's own code for a service "
                   "this project does not bring, so it is not answered here; an agent of ours runs with "
                   "--agent-function-path (docs/agents.md), over the official OpenAI or Anthropic clients",
}

# Other packages slime's examples import -> what they are and how to get them (said where one is not installed).
PACKAGES: dict[str, str] = {
    "strands": "Strands Agents (PyPI strands-agents), the agent loop of slime's strands_sglang example: "
               "pip install -e '.[strands]' installs it with strands-sglang",
    "strands_sglang": "strands-sglang (PyPI), the SGLang model of slime's strands_sglang example: "
                      "pip install -e '.[strands]'",
    "tau_bench": "sierra-research's tau-bench, which slime's tau-bench example imports, is not on PyPI: slime's "
                 "README installs a fork from git (JD-ETH/tau-bench, branch feature/litellm-retry, pip install -e . "
                 "--no-deps, with litellm beside it), and its rollouts need a hosted LLM as the user simulator (a "
                 "Gemini API key in generate_with_tau.py); the example's tool parser also imports SGLang "
                 "(pip install -e '.[sglang]', Python >= 3.11)",
}


def offered_modules() -> list[str]:
    """The modules the shim answers with names of their own (the packages above them hold only modules)."""
    return [module for module, names in OFFERED.items() if names]


def _not_offered(fullname: str) -> str:
    reason = next((why for prefix, why in MISSING.items() if (fullname + ".").startswith(prefix + ".")), "")
    because = f": {reason}" if reason else ""
    return (f"No module named {fullname!r} here{because}. slime is not installed; Slipstream answers these of its "
            f"modules with its own equivalents, listed with their names in {DOC}: {', '.join(offered_modules())}")


class SlimeModule(ModuleType):
    """One of slime's modules as the shim answers it: its offered names, each of ours; any other name fails with
    an ImportError that says what the module has (an AttributeError would lose the message in ``from m import x``)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        submodule = f"{self.__name__}.{name}"
        if submodule in OFFERED:
            return importlib.import_module(submodule)
        names = sorted(OFFERED.get(self.__name__, {}))
        below = sorted(other for other in OFFERED if other.rpartition(".")[0] == self.__name__)
        has = f"it has {', '.join(names)}" if names else f"it holds only the modules {', '.join(below)}"
        raise ImportError(f"{self.__name__}.{name} is not offered here ({has}; slime is not installed and these "
                          f"names are Slipstream's own equivalents of slime's, {DOC})",
                          name=self.__name__)


class SlimeImportFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers ``slime`` and its offered submodules when no other finder can import ``slime``."""

    def find_spec(self, fullname: str, path: Any = None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname in PACKAGES:  # last on sys.meta_path: no finder before ours has it, so it is not installed
            raise ModuleNotFoundError(f"No module named {fullname!r}: {PACKAGES[fullname]}", name=fullname)
        if fullname != ROOT and not fullname.startswith(ROOT + "."):
            return None
        if fullname == ROOT:
            if self._another_finds_slime():
                return None
        elif not self.answered(sys.modules.get(ROOT)):
            return None  # below a real slime: its own modules, or Python's error, never ours
        if fullname not in OFFERED:
            raise ModuleNotFoundError(_not_offered(fullname), name=fullname)
        # every one a package, so that an import of a submodule not offered reaches find_spec and its message
        return importlib.util.spec_from_loader(fullname, self, is_package=True)

    def _another_finds_slime(self) -> bool:
        """A finder placed after ours (an editable install's hook added later) still wins."""
        finders = sys.meta_path
        later = finders[finders.index(self) + 1:] if self in finders else []
        return any(finder.find_spec(ROOT, None) is not None for finder in later if hasattr(finder, "find_spec"))

    def answered(self, module: ModuleType | None) -> bool:
        spec = getattr(module, "__spec__", None)
        return isinstance(getattr(spec, "loader", None), SlimeImportFinder)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return SlimeModule(spec.name)

    def exec_module(self, module: ModuleType) -> None:
        names = OFFERED[module.__name__]
        for name, target in names.items():
            where, _, attr = target.partition(":")
            setattr(module, name, getattr(importlib.import_module(where), attr))
        module.__all__ = sorted(names)
        module.__doc__ = (f"slime's {module.__name__}, answered by Slipstream with its own equivalents "
                          f"(actors.slime_compat.imports): slime is not installed.")


def install() -> None:
    """Once per process (importing `actors` does it), last on ``sys.meta_path``."""
    if not any(isinstance(finder, SlimeImportFinder) for finder in sys.meta_path):
        sys.meta_path.append(SlimeImportFinder())
