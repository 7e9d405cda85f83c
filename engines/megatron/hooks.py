"""slime's two per-step Megatron hooks, run by the Megatron trainer at slime's call points.

`--custom-megatron-before-log-prob-hook-path`: `hook(args, model, store_prefix)` once per log-prob pass (not per
micro-batch), after the network is put in eval mode and before its first forward; `model` is the list of model
chunks the pass runs (ours: one), `store_prefix` says which pass it is as slime names it ("" for the policy's
old log-probs, "ref_" for the reference model's, "teacher_" for a distillation teacher's: every named teacher's,
slime having one).

`--custom-megatron-before-train-step-hook-path`: `hook(args, rollout_id, step_id, model, optimizer,
opt_param_scheduler)` once per optimizer step, after the gradients are zeroed and before the step's first forward.
`rollout_id` is the 0-based index of the rollout batch this trainer is training (batches it finished before),
`step_id` the 0-based optimizer step within that batch (several with `--num-steps-per-rollout`). `optimizer` is
megatron's optimizer; `opt_param_scheduler` is None: the trainer sets the learning rate of each step itself
(`engines.training.base.scheduled_lr`), there is no megatron scheduler object.

Return values are ignored, as in slime. `args` is the run's namespace (`MegatronFlags.namespace()`), the same
object on every call, so a hook may keep state on it. A hook that raises stops the call with an error naming the
flag and the path: a broken plugin must not pass for a training failure.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from engines.megatron.model_flags import MegatronFlags
from engines.training.base import TEACHER_ROLE_PREFIX, ModelRole

LOG_PROB_FLAG = "--custom-megatron-before-log-prob-hook-path"
TRAIN_STEP_FLAG = "--custom-megatron-before-train-step-hook-path"


def _store_prefix(role: ModelRole) -> str:
    """slime's name of a log-prob pass: where its rollout data keeps the pass's log-probs."""
    if role == "ref":
        return "ref_"
    return "teacher_" if role.startswith(TEACHER_ROLE_PREFIX) else ""


class HookError(RuntimeError):
    """A user hook raised; the message names its flag and dotted path."""


class _Hook:
    """One loaded hook and the flag that named it."""

    def __init__(self, flag: str, path: str) -> None:
        from policies.plugins import load_callable

        self.flag, self.path = flag, path
        self._function: Callable[..., Any] = load_callable(path, what=flag)

    def __call__(self, *args: Any) -> None:
        try:
            self._function(*args)
        except Exception as error:
            raise HookError(f"{self.flag} {self.path!r} raised {type(error).__name__}: {error}") from error


class StepHooks:
    """The hooks a run set (loaded at trainer start-up, so a bad path fails before the model is built) and the
    trainer's position in the run, which the train-step hook receives."""

    def __init__(self, flags: MegatronFlags) -> None:
        log_prob, train_step = flags.before_log_prob_hook_path, flags.before_train_step_hook_path
        self._before_log_prob = _Hook(LOG_PROB_FLAG, log_prob) if log_prob else None
        self._before_train_step = _Hook(TRAIN_STEP_FLAG, train_step) if train_step else None
        self._args: argparse.Namespace | None = flags.namespace() if log_prob or train_step else None
        self.rollout_id = 0
        self.step_id = 0

    def before_log_prob(self, model: Sequence[Any], role: ModelRole) -> None:
        """`role` is the pass's network (`compute_log_probs(model=...)`)."""
        if self._before_log_prob is not None:
            self._before_log_prob(self._args, list(model), _store_prefix(role))

    def before_train_step(self, model: Sequence[Any], optimizer: Any) -> None:
        if self._before_train_step is not None:
            self._before_train_step(self._args, self.rollout_id, self.step_id, list(model), optimizer, None)

    def after_train_step(self, *, ends_batch: bool) -> None:
        """Advance the position: the next step is the batch's next one, or the next batch's first."""
        if ends_batch:
            self.rollout_id += 1
            self.step_id = 0
        else:
            self.step_id += 1

    def state(self) -> dict[str, int]:
        """What a checkpoint stores (written between batches, so step_id is 0)."""
        return {"rollouts_trained": self.rollout_id}

    def restore(self, state: dict[str, Any]) -> None:
        """From a checkpoint's state; an older one without the count falls back to the version (equal unless a
        whole batch was skipped)."""
        self.rollout_id = int(state.get("rollouts_trained", state["version"]))
        self.step_id = 0
