"""Episodes across policies: the samples one episode returns, told apart by the policy that generated them.

In a run of several policies an episode of policy P may call another policy Q (`RolloutContext.engine_of`): a
proposer's problem solved by a solver, the other player's moves, a judge. Each policy trains on its own turns only,
so Q's turns go to Q: the episode builds them on a group of Q's (`RolloutContext.group_for`) and returns them with
P's own. The worker sends P's group as every group, and each of Q's groups to Q's reward and buffer, which adopts it:
it was never leased, and is trained at most once however often P's group is generated again (its id is the same).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from actors.rollout.generate import RolloutContext
from bus.schema import PromptGroup, Sample


@dataclass(frozen=True)
class PolicyTurns:
    """Another policy's group in an episode, and the samples the episode built on it."""

    policy: str
    group: PromptGroup
    samples: list[Sample]


def split_by_policy(context: RolloutContext, group: PromptGroup,
                    samples: list[Sample]) -> tuple[list[Sample], list[PolicyTurns]]:
    """`group`'s own samples, and each other policy's group the episode opened, with its samples (in the order they
    were opened; one without samples is left out). A sample of any other group is an error naming it: it would
    otherwise train a policy nobody asked it to."""
    own: list[Sample] = []
    by_group: dict[str, list[Sample]] = defaultdict(list)
    strays: list[str] = []
    for sample in samples:
        if sample.group_id == group.group_id:
            own.append(sample)
        elif sample.group_id in context.other_groups:
            by_group[sample.group_id].append(sample)
        else:
            strays.append(sample.sample_id)
    if strays:
        raise ValueError(f"the generate function returned samples of groups that are neither its group "
                         f"{group.group_id!r} nor one it opened for another policy (RolloutContext.group_for): "
                         f"{strays[:3]}")
    others = [PolicyTurns(policy, turns, by_group[group_id])
              for group_id, (policy, turns) in context.other_groups.items() if by_group.get(group_id)]
    return own, others
