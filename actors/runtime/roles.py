"""Built-in roles and the classes that play them; custom actors are named by dotted path instead."""

from __future__ import annotations

from typing import TYPE_CHECKING

from policies.plugins import load_object

if TYPE_CHECKING:
    from actors.config import RunConfig

BUILTIN_ROLES: dict[str, str] = {
    "controller": "actors.controller.actor:Controller",
    "buffer": "actors.buffer.actor:Buffer",
    "evaluator": "actors.evaluator.actor:Evaluator",  # only in a run with eval data (runs_evaluator)
    "learner": "actors.learner.actor:Learner",
    "rollout": "actors.rollout.actor:RolloutWorker",
    "reward": "actors.reward.actor:RewardWorker",
    # On each node of a learner that spans nodes, other than the head (launcher.py adds it there).
    "learner-ranks": "actors.learner.remote_ranks:RemoteLearnerRanks",
}
HEAD_ROLES = ("controller", "buffer", "evaluator", "learner", "rollout", "reward")  # the head's, unless --roles says


def runs_evaluator(config: RunConfig) -> bool:
    """Whether the run has an evaluator: it has eval sets (which need --eval-interval), and engines to generate them
    (a replay of recorded batches, --load-debug-rollout-data, runs none)."""
    return config.eval.evaluates and not config.learner.load_debug_rollout_data


def has_weight_pinners(config: RunConfig) -> bool:
    """Whether a role of the run asks the learner to hold the engines on a version (`WeightPin`: the evaluator), so
    the learner's first push waits for its first ask (`WeightCadence.expect_pins`)."""
    return runs_evaluator(config)


def resolve_actor_class(path: str) -> type:
    """Load an actor class from `package.module:ClassName` and check that it is an Actor."""
    from actors.runtime.base import Actor

    cls = load_object(path, what="actor class")
    if not (isinstance(cls, type) and issubclass(cls, Actor)):
        raise TypeError(f"actor class {path!r} is {cls!r}, not a subclass of actors.runtime.base.Actor")
    return cls
