"""Several policies in one run: their names, their actors' ids, and what each may set for itself.

A policy is a set of actors (its buffer, learner and evaluator) and a version stream; the rollout and reward
workers, the controller and the engines are shared. Each policy is a LoRA adapter of the run's base model, served
by name beside the others on every engine (`engines.inference.multi_lora`), so the base model's engines generate
for all of them. A policy's settings are the run's, with its own overrides on top: data, reward, loss, optimizer,
staleness bound, eval sets. What the policies share (the base model, the engines, placement, the adapter's shape,
the transfer mechanism) stays run-wide, and an override of it is refused, naming the policy and the setting. Each
policy's own `RunConfig` is `actors.config.run.policy_run_config`.

A policy may instead have engines of its own (`own_engines: N`): N rollout workers of its own, each with an engine
of its own model (its own --hf-checkpoint, trained in full or with its own LoRA), which generate for it alone; it
shares the rest (controller, reward workers, clock, run directory, certificate). Such a policy may set its model,
engine and LoRA settings, and its workers' generate function, which the others may not.

A run without `policies` has one unnamed policy, and nothing about it changes: its actors keep their ids
("learner", "buffer") and its wire messages name no policy.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

POLICY_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
# Sections every policy shares: one base model on shared engines, placed once, its adapters of one shape; the
# agent surface is served by the shared rollout workers.
SHARED_SECTIONS = ("model", "engine", "router", "weights", "placement", "controller", "logging", "megatron", "lora",
                   "agent")
# Settings of other sections that every policy shares, and why.
SHARED_SETTINGS = {
    **dict.fromkeys(("train_backend", "learner_ranks", "tensor_model_parallel_size", "pipeline_model_parallel_size"),
                    "every policy's learner is placed alike"),
    **dict.fromkeys(("custom_generate_function_path", "rollout_function_path"),
                    "the shared rollout workers run one generate function for every policy"),
    **dict.fromkeys(("debug_rollout_only", "debug_train_only", "load_debug_rollout_data"),
                    "a debug mode changes which actors the run starts"),
}
OWN_ENGINES = "own_engines"  # the setting that gives a policy engines of its own (EngineConfig.own_engines)
# What a policy with engines of its own also sets for itself: its model, its engines, its adapter's shape
# (lora_rank 0: trained in full), and the generate function its own workers run.
OWN_ENGINE_SECTIONS = ("model", "engine", "lora")
OWN_ENGINE_SETTINGS = ("custom_generate_function_path",)
# How many named adapters a torch engine holds (engines.inference.multi_lora): the most policies a run can have.
TORCH_ENGINE_ADAPTERS = 8
# What a rollout worker says of its engine when it registers (Register.meta): how many policies' adapters it has room
# for, and why; the controller refuses a join past the least room (actors.controller.policy_table).
ADAPTER_ROOM, ADAPTER_ROOM_WHY = "adapter_room", "adapter_room_why"
POLICY_ROLES = ("buffer", "evaluator", "learner")  # one of each per policy; the other roles are shared
SCOPE_SEPARATOR = "@"  # a policy's actor id: "learner@solver"
POLICIES_DIR = "policies"  # RUN_DIR/policies/<name>: a policy's own run directory


def scoped_actor_id(role: str, policy: str | None) -> str:
    """The id of a policy's actor of `role` ("learner@solver"); the role itself in a run of one unnamed policy."""
    return role if policy is None else f"{role}{SCOPE_SEPARATOR}{policy}"


def policy_run_dir(run_dir: Path, policy: str | None) -> Path:
    """Where a policy's actors keep their files (logs, metrics, checkpoints, buffer log, config.yaml): laid out as a
    run directory of its own, so every tool that reads one reads a policy's; the run's own in a run of one policy."""
    return run_dir if policy is None else run_dir / POLICIES_DIR / policy


def policy_of_run_dir(directory: Path) -> str | None:
    """The policy whose run directory `directory` is (RUN_DIR/policies/<name>, in a run directory with its
    config.yaml): what a tool given a policy's directory reads from its run's (the shared engines' accounts, the run's
    clock). None for a run's own directory."""
    parent = directory.parent
    if parent.name != POLICIES_DIR or not POLICY_NAME.fullmatch(directory.name):
        return None
    return directory.name if (parent.parent / "config.yaml").is_file() else None


def override_problems(policy: str, overrides: Any, section_of: Mapping[str, str]) -> list[str]:
    """What is wrong with `policy`'s name and the settings it overrides, before they are validated as values;
    `section_of` maps each flat setting to the section that owns it."""
    problems = []
    if not POLICY_NAME.fullmatch(policy):
        problems.append(f"policies: name {policy!r} must be lower-case letters, digits and _, starting with a "
                        "letter, at most 32 characters (it names actors, files and adapters)")
    if not isinstance(overrides, dict):
        return [*problems, f"policies.{policy}: expected a mapping of settings, got {type(overrides).__name__}"]
    own = own_engine_workers(overrides) > 0
    for setting in overrides:
        section = section_of.get(setting)
        if section is None:
            where = "a section name" if setting in section_of.values() else "not a setting"
            problems.append(f"policies.{policy}.{setting}: {where}; a policy sets flat settings (lr, prompt_data, "
                            "max_staleness, ...)")
        elif setting == OWN_ENGINES or (own and (section in OWN_ENGINE_SECTIONS or setting in OWN_ENGINE_SETTINGS)):
            continue
        elif section in SHARED_SECTIONS:
            mine = " (or give the policy engines of its own: own_engines: true)" * (section in OWN_ENGINE_SECTIONS)
            problems.append(f"policies.{policy}.{setting}: shared by every policy (the {section} section: one base "
                            f"model on shared engines); set it for the whole run{mine}")
        elif setting in SHARED_SETTINGS:
            problems.append(f"policies.{policy}.{setting}: shared by every policy ({SHARED_SETTINGS[setting]}); set "
                            "it for the whole run")
    return problems


def own_engine_workers(overrides: Any) -> int:
    """The rollout workers of its own a policy's settings ask for (`own_engines`; true is 1); 0: it shares the run's
    engines. Read from the raw settings, before they are validated (a value that is not a count is refused then)."""
    value = overrides.get(OWN_ENGINES, 0) if isinstance(overrides, Mapping) else 0
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    return int(value) if isinstance(value, (bool, int)) and value > 0 else 0


def sharing_engines(policies: Mapping[str, Any]) -> dict[str, Any]:
    """The policies (name -> settings) that share the run's engines as LoRA adapters: every one without engines of
    its own. What the shared engines load adapters for, and the shared rollout workers open lanes for."""
    return {name: settings for name, settings in policies.items() if not own_engine_workers(settings)}


def served_elsewhere(policies: Mapping[str, Any], served_here: Iterable[str | None], *,
                     own_engine: bool) -> dict[str, str]:
    """The run's declared policies an engine does not serve, each with where it is served instead: an episode can
    call only the policies on its own engine (`engine_of`), and one naming another must be told why not.
    `own_engine`: the engine is one policy's own."""
    here = set(served_here)
    return {name: ("on engines of its own (own_engines)" if own_engine_workers(settings)
                   else "on the run's shared engines" if own_engine else "nowhere now: it left the run")
            for name, settings in policies.items() if name not in here}


def own_engines_problems(config: Any) -> list[str]:
    """What is wrong with the run's (a `RunConfig`'s, with `policies`) engines of its policies' own."""
    problems = []
    if config.engine.own_engines:
        problems.append(f"own_engines {config.engine.own_engines} for the whole run: a policy's setting; set it "
                        "under policies.NAME for the policy that runs engines of its own")
    return problems


def sglang_loras_per_batch(declared: int) -> int:
    """--max-loras-per-batch for an SGLang server the run launches: room for every declared policy's adapter and
    the version it replaces mid-push, the base model, and at least SGLang's default."""
    from engines.sglang.protocol import LORAS_PER_BATCH  # imports torch: only when a policy is joining or launched

    return max(LORAS_PER_BATCH, 2 * declared + 1)


def policy_capacity(engine: str, declared: int, *, attached: bool) -> int | None:
    """The most policies the run's engines have room for by the run's settings, as a join is checked (None: not
    known from them: an attached SGLang server has the room it was started with, which its rollout worker reads
    from the server and says when it registers, `ADAPTER_ROOM`)."""
    if engine == "torch":
        return TORCH_ENGINE_ADAPTERS
    if engine == "sglang" and not attached:
        from engines.sglang.protocol import policies_room

        return policies_room(sglang_loras_per_batch(declared))
    return None


def run_dir_policies(run_dir: Path, declared: list[str]) -> list[str]:
    """Every policy that took part in a run: those it declared, then those that joined it while it ran (each keeps a
    directory of its own, RUN_DIR/policies/<name>, with its config.yaml)."""
    root = run_dir / POLICIES_DIR
    joined = sorted(path.name for path in root.iterdir() if POLICY_NAME.fullmatch(path.name)
                    and (path / "config.yaml").is_file()) if root.is_dir() else []
    return [*declared, *(name for name in joined if name not in declared)]
