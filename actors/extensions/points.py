"""What each kind of plugin is, as the roles call it: the types `actors.extensions.load` returns.

Free of torch at run time: the buffer, whose process never imports it, takes its batch selector from here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from bus.schema import Batch, Sample, ScoredGroup

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch import Tensor

    from engines.training.base import TrainSample
    from policies.config import PolicyLossConfig
    from policies.losses import PolicyLossInputs, PolicyLossTerms

# The buffer's next batch: (scored groups in admission order, groups wanted, batch id) -> the chosen group ids;
# the buffer fills any shortfall with the oldest groups.
BatchSelector = Callable[[list[ScoredGroup], int, int], list[str]]
# A dynamic-sampling filter over one scored group: a drop reason, or None to keep it.
GroupFilter = Callable[[ScoredGroup], "str | None"]
# A recording's batch N, read for the learner at version v: (N, v) -> the batch.
BatchReader = Callable[[int, int], Batch]


class GeneratedGroupsHook(Protocol):
    """Sees every group generated for each training batch, the dropped ones too: the buffer tells it each group it
    drops (`dropped`) and, when a batch is first assembled, the groups that batch trains (`assembled`)."""

    def dropped(self, group: ScoredGroup, reason: str) -> None: ...

    def assembled(self, batch_id: int, groups: Sequence[ScoredGroup]) -> None: ...

# A whole eval round made by one call of a function (slime's --eval-function-path). Its owner hands the buffer one
# group with WHOLE_ROUND in its metadata (the evaluated version); the rollout worker that leases it calls the round
# function instead of generating, and sends back one scored sample per result, each naming its dataset
# (ROUND_DATASET in its metadata); the first carries the function's own metrics (ROUND_METRICS).
WHOLE_ROUND = "whole_round_version"
ROUND_DATASET = "round_dataset"
ROUND_METRICS = "round_metrics"


@dataclass(frozen=True)
class BatchRewrite:
    """The learner's whole-batch rewrite before the step (new rewards, new samples): samples in, samples out.

    `rewards_as_given`: the rewrite's rewards are final, trained without the group baseline on top (a rewrite that
    normalises rewards itself, as slime's hooks replace slime's group normalisation)."""

    rewrite: Callable[[list[Sample]], list[Sample]]
    rewards_as_given: bool

    def __call__(self, samples: list[Sample]) -> list[Sample]:
        return self.rewrite(samples)


class SelectionError(ValueError):
    """A batch selector's answer that cannot be used; ``reason`` names the kind in the fallback counter."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class AdvantageFunction(Protocol):
    """Replaces the advantage estimator for one shard: packed `[T]` advantages of `samples`, masked (and whitened
    when asked) like the built-in ones. Every data-parallel rank calls it, each with its own whole groups."""

    def __call__(self, policy: PolicyLossConfig, samples: list[TrainSample], group_ids: Tensor, *,
                 process_group: dist.ProcessGroup | None = None) -> Tensor: ...


class PolicyLossFunction(Protocol):
    """The policy loss of `--loss-type`: a registered one or a plugin, per token of one micro-batch."""

    def __call__(self, config: PolicyLossConfig, inputs: PolicyLossInputs) -> PolicyLossTerms: ...


class RolloutLoop(Protocol):
    """Replaces a rollout worker's lease -> generate -> send loop as a whole (it leases and sends itself)."""

    async def run(self) -> None: ...

    def metrics(self) -> dict[str, float]: ...


class RolloutLogHook(Protocol):
    """Called on each batch the learner trains with its samples and the rollout metrics about to be written (it may
    add keys); True: leave those metrics out (the hook logged them its own way)."""

    def __call__(self, batch_id: int, samples: Sequence[Sample], metrics: dict[str, Any],
                 rollout_time: float) -> bool: ...


class EvalLogHook(Protocol):
    """Called on each finished eval round of `dataset` at `version` with its scored samples and the metrics about to
    be written; True: leave the round's default metrics out."""

    def __call__(self, version: int, dataset: str, samples: Sequence[Sample], metrics: dict[str, Any]) -> bool: ...


__all__ = ["ROUND_DATASET", "ROUND_METRICS", "WHOLE_ROUND", "AdvantageFunction", "BatchReader", "BatchRewrite",
           "BatchSelector", "EvalLogHook", "GeneratedGroupsHook", "GroupFilter", "PolicyLossFunction",
           "RolloutLogHook", "RolloutLoop", "SelectionError"]
