"""Small typed registries: a config name maps to a function, and a user's dotted path plugs in the same way.

Each kind (advantage estimator, policy loss, KL estimator, off-policy correction, reward, group reward, sample
filter) has one :class:`Registry`. Built-ins register themselves with decorators in their own modules; the
registry imports those modules lazily on first lookup, so ``policies.registry`` itself imports nothing of ours
and there is no import cycle. ``resolve_<kind>(name_or_path)`` accepts a registered name or a dotted path
``package.module:attr`` (see :mod:`policies.plugins`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from policies.plugins import PluginError, is_dotted_path, load_object

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "CORRECTIONS",
    "FILTERS",
    "GROUP_REWARDS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "REWARDS",
    "Registry",
    "register_advantage_estimator",
    "register_correction",
    "register_filter",
    "register_group_reward",
    "register_kl",
    "register_policy_loss",
    "register_reward",
    "resolve_advantage_estimator",
    "resolve_correction",
    "resolve_filter",
    "resolve_group_reward",
    "resolve_kl",
    "resolve_policy_loss",
    "resolve_reward",
]

F = TypeVar("F", bound=Callable[..., Any])


class Registry(Generic[F]):
    """Name -> callable for one kind of policy component.

    ``builtin_modules`` are imported on first lookup; they register the built-in names as a side effect.
    Registering a different object under a taken name is an error (two plugins silently shadowing each other is
    the kind of bug that costs a training run).
    """

    def __init__(self, kind: str, builtin_modules: tuple[str, ...], builtin_names: tuple[str, ...] = ()) -> None:
        self.kind = kind
        self._builtin_modules = builtin_modules
        self.builtin_names = frozenset(builtin_names)  # what those modules register: checkable without importing
        self._entries: dict[str, F] = {}
        self._loaded = False

    def register(self, name: str) -> Callable[[F], F]:
        if not name or is_dotted_path(name):
            raise ValueError(
                f"{self.kind} name {name!r}: registered names must be non-empty and contain no '.' or ':'"
            )

        def decorator(fn: F) -> F:
            existing = self._entries.get(name)
            if existing is not None and existing is not fn:
                raise ValueError(f"{self.kind} {name!r} is already registered to {existing!r}")
            self._entries[name] = fn
            return fn

        return decorator

    def names(self) -> list[str]:
        self._load_builtins()
        return sorted(self._entries)

    def resolve(self, name_or_path: str) -> F:
        """The registered callable for a name, or the object a dotted path names (which must be callable)."""
        if not isinstance(name_or_path, str):
            raise TypeError(f"{self.kind}: expected a name or dotted path, got {type(name_or_path).__name__}")
        if is_dotted_path(name_or_path):
            obj = load_object(name_or_path, what=self.kind)
            if not callable(obj):
                raise PluginError(f"{self.kind} {name_or_path!r}: {type(obj).__name__} object is not callable")
            return obj  # type: ignore[return-value]
        self._load_builtins()
        try:
            return self._entries[name_or_path]
        except KeyError:
            known = ", ".join(sorted(self._entries)) or "(none)"
            raise ValueError(
                f"unknown {self.kind} {name_or_path!r}; registered: {known}; "
                "or give a dotted path 'package.module:attr'"
            ) from None

    def check(self, name_or_path: str) -> None:
        """Raise as `resolve` would for an unknown name or a broken path, but accept a declared built-in name
        without importing its module: validating a config (every actor does) must not import torch, which the
        built-in implementations need, in a process that never calls them (a rollout worker)."""
        if isinstance(name_or_path, str) and name_or_path in self.builtin_names:
            return
        self.resolve(name_or_path)

    def _load_builtins(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        for module in self._builtin_modules:
            importlib.import_module(module)
        undeclared = sorted(self.builtin_names - set(self._entries))
        if undeclared:
            raise RuntimeError(f"{self.kind}: {', '.join(undeclared)} declared built-in but not registered by "
                               f"{', '.join(self._builtin_modules)}")


ADVANTAGE_ESTIMATORS: Registry[Callable[..., Any]] = Registry(
    "advantage estimator", ("policies.advantages",),
    ("cispo", "grpo", "gspo", "ppo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo"))
POLICY_LOSSES: Registry[Callable[..., Any]] = Registry("policy loss", ("policies.losses",),
                                                       ("cispo", "gspo", "ppo", "sft"))
KL_ESTIMATORS: Registry[Callable[..., Any]] = Registry("KL estimator", ("policies.kl",),
                                                       ("k1", "k2", "k3", "low_var_kl"))
CORRECTIONS: Registry[Callable[..., Any]] = Registry("off-policy correction", ("policies.corrections",),
                                                     ("icepop", "mis", "none", "tis"))
REWARDS: Registry[Callable[..., Any]] = Registry("reward function", ("policies.rewards.builtin",))
GROUP_REWARDS: Registry[Callable[..., Any]] = Registry("group reward function", ("policies.rewards.builtin",))
FILTERS: Registry[Callable[..., Any]] = Registry("sample filter", ("policies.filters",))


def register_advantage_estimator(name: str) -> Callable[[F], F]:
    return ADVANTAGE_ESTIMATORS.register(name)


def register_policy_loss(name: str) -> Callable[[F], F]:
    return POLICY_LOSSES.register(name)


def register_kl(name: str) -> Callable[[F], F]:
    return KL_ESTIMATORS.register(name)


def register_correction(name: str) -> Callable[[F], F]:
    return CORRECTIONS.register(name)


def register_reward(name: str) -> Callable[[F], F]:
    return REWARDS.register(name)


def register_group_reward(name: str) -> Callable[[F], F]:
    return GROUP_REWARDS.register(name)


def register_filter(name: str) -> Callable[[F], F]:
    return FILTERS.register(name)


def resolve_advantage_estimator(name_or_path: str) -> Callable[..., Any]:
    return ADVANTAGE_ESTIMATORS.resolve(name_or_path)


def resolve_policy_loss(name_or_path: str) -> Callable[..., Any]:
    return POLICY_LOSSES.resolve(name_or_path)


def resolve_kl(name_or_path: str) -> Callable[..., Any]:
    return KL_ESTIMATORS.resolve(name_or_path)


def resolve_correction(name_or_path: str) -> Callable[..., Any]:
    return CORRECTIONS.resolve(name_or_path)


def resolve_reward(name_or_path: str) -> Callable[..., Any]:
    return REWARDS.resolve(name_or_path)


def resolve_group_reward(name_or_path: str) -> Callable[..., Any]:
    return GROUP_REWARDS.resolve(name_or_path)


def resolve_filter(name_or_path: str) -> Callable[..., Any]:
    return FILTERS.resolve(name_or_path)
