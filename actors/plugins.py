"""Everything a plugin imports from Slipstream, in one module that stays put.

Write generate functions, environments, agents, reward functions and custom actors against these names:
`from actors.plugins import RolloutContext, make_sample`. The modules that define them may move as the house is
rebuilt; this one does not, and `tests/actors/test_plugin_surface.py` fails if a name leaves it. A module a plugin
imported directly that has since moved still imports, with a warning naming its new place (`actors.moved`).

- a generate function (`--custom-generate-function-path`): `async def fn(context: RolloutContext, group:
  PromptGroup) -> list[Sample]`, calling `context.engine.generate(GenerateRequest(...))` and building each sample
  with `make_sample` (or `failed_samples`); `default_generate` is the built-in single turn, to wrap or fall back on;
- an environment (`--agent-environment-path`): a factory of `Environment`s whose `step(Turn)` returns an `EnvStep`;
- an agent over the OpenAI API (`--agent-function-path`): `async def agent(episode: Episode) -> dict | None`;
- a reward function (`--custom-rm-path`): `def fn(sample: RewardInput) -> float`, or a dict with a "reward"
  number and extras to log (async allowed; with `--group-rm`, a list of inputs in and a list out); the reward worker
  turns what it returned, raised or overran into a `RewardOutcome`;
- a custom actor (`--custom-actor NAME=module:Class`): a subclass of `Actor` with `@handles`, `@serves` and
  `@on_broadcast` methods and an optional `run()` loop; its `@method`s are what other actors and plugins call, by
  name: `await call_actor("judge", "score", timeout=10, prompt=...)`, which raises `ActorCallError` when no result
  comes (a judge that is down, slow, or failing). A setting it cannot work with is a `ConfigError`: the run fails
  with it instead of restarting the actor. `examples/judge/` is a complete one, and docs/custom-actors.md says how
  it works.
"""

from __future__ import annotations

from actors.config import ConfigError
from actors.rollout.agent import Episode
from actors.rollout.environment import Environment, EnvStep, Turn
from actors.rollout.generate import (
    GenerateFunction,
    NoRoomError,
    RolloutContext,
    default_generate,
    failed_samples,
    make_sample,
)
from actors.rollout.trajectory import Trajectory
from actors.runtime.base import Actor
from actors.runtime.context import ActorContext
from actors.runtime.handlers import handles, method, on_broadcast, serves
from actors.runtime.host import ActorCallError, call_actor
from bus.schema import STATUS_BY_FINISH, GeneratedGroup, PromptGroup, Sample
from engines.inference.base import GenerateOutput, GenerateRequest, SamplingParams
from policies.rewards import RewardInput, RewardOutcome

__all__ = [
    "STATUS_BY_FINISH", "Actor", "ActorCallError", "ActorContext", "ConfigError", "EnvStep", "Environment", "Episode",
    "GenerateFunction", "GenerateOutput", "GenerateRequest", "GeneratedGroup", "NoRoomError", "PromptGroup",
    "RewardInput", "RewardOutcome", "RolloutContext", "Sample", "SamplingParams", "Trajectory", "Turn",
    "call_actor", "default_generate", "failed_samples", "handles", "make_sample", "method", "on_broadcast", "serves",
]
