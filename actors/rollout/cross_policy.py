"""Episodes across policies: the samples one episode returns, told apart by the policy that generated them.

In a run of several policies an episode of policy P may call another policy Q (`RolloutContext.engine_of`): a
proposer's problem solved by a solver, the other player's moves, a judge. Each policy trains on its own turns only,
so Q's turns go to Q: the episode builds them on a group of Q's (`RolloutContext.group_for`) and returns them with
P's own. The worker sends P's group as every group, and each of Q's groups to Q's reward and buffer, which adopts it:
it was never leased, and is trained at most once however often P's group is generated again (its id is the same).

An agent episode (`--agent-function-path`) calls Q through the rollout worker's endpoint, by naming Q as a request's
`model` (`actors.rollout.openai_endpoint`). `AgentCalls` gives those calls a conversation of Q's own, apart from the
episode's, and turns them into Q's group of this kind when the episode ends.

Q may fall behind what P's episodes make of it: Q's buffer bounds the groups it adopted that wait untrained
(`actors.buffer.adoption`), and P's lane holds its episodes back while Q has no room (`Crossing`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from actors.rollout.chat_session import ChatSession
from actors.rollout.generate import RolloutContext, failed_sample, other_group_id
from bus.schema import PromptGroup, Sample

AGENT_KEY = "agent"  # the key of the group an agent's calls to a policy form: `HOST@POLICY.agent`


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


class AgentCalls:
    """The calls the agent episodes of one group make to other policies. Each policy called gets one group in the
    episode (`group_for(policy, group, "agent")`), whose episode i is episode i's conversation with it: its calls,
    sampled from that policy's adapter by that policy's settings, several contexts making several segments as for the
    episode's own. So that group's n episodes are the host group's n episodes (the policies' --n-samples-per-prompt
    must agree), and a group-relative advantage compares the policy's turns across the host's episodes of one task:
    its prompt and label are the host group's, and its samples' conversations are in `Sample.messages`."""

    def __init__(self, context: RolloutContext, group: PromptGroup) -> None:
        self.context, self.group = context, group
        self.groups: dict[str, PromptGroup] = {}
        self.sessions: dict[tuple[str, int], ChatSession] = {}

    def session(self, policy: str, index: int) -> ChatSession:
        """Episode `index`'s conversation with `policy` (another policy of the run), opened at its first call."""
        if (policy, index) not in self.sessions:
            self.sessions[policy, index] = ChatSession(self.context, self._group(policy), index,
                                                       engine=self.context.engine_of(policy))
        return self.sessions[policy, index]

    def samples(self, returned: Mapping[int, Mapping[str, Any]]) -> list[Sample]:
        """Every called policy's group, episode by episode: what `returned[i]` (episode i's agent's dict, less the
        tool counts, which are its own policy's) says on each of its samples, and a failed sample, naming why, for an
        episode that never called that policy (its group trains on the others, `--failed-sample-policy`)."""
        samples: list[Sample] = []
        for policy, turns in self.groups.items():
            for index in range(self.group.n_samples):
                session = self.sessions.get((policy, index))
                if session is None or not session.segments:
                    samples.append(failed_sample(turns, index, [], (
                        f"episode {index} of group {self.group.group_id} ({self.context.policy}) made no call to "
                        f"policy {policy}: its group {turns.group_id} holds each episode's calls to {policy}")))
                    continue
                said = {key: value for key, value in (returned.get(index) or {}).items()
                        if key not in ("tool_calls", "tool_errors")}
                samples += session.to_samples(metadata=said)
        return samples

    def _group(self, policy: str) -> PromptGroup:
        if policy in self.groups:
            return self.groups[policy]
        # By the settings, not the group: an eval round's group may be of another size, and trains nobody.
        theirs, ours = (config.rollout.n_samples_per_prompt for config in (self.context.policy_configs[policy],
                                                                            self.context.config))
        if theirs != ours:
            raise ValueError(f"policy {policy!r} has --n-samples-per-prompt {theirs} and this episode's policy "
                             f"{self.context.policy!r} {ours}: an agent's calls to {policy} make one {policy} "
                             f"episode of each {self.context.policy} episode, so the two must be the same")
        # The episode generated again on this context (an abort, `unless_aborted`) opens the group it opened before.
        opened = self.context.other_groups.get(other_group_id(self.group, policy, AGENT_KEY))
        turns = opened[1] if opened is not None else self.context.group_for(
            policy, self.group, AGENT_KEY, self.group.prompt, label=self.group.label,
            metadata=dict(self.group.metadata))
        self.groups[policy] = turns
        return turns
@dataclass(eq=False)  # a key of the worker's open waits
class Crossing:
    """A lane's part in episodes across policies: the policies its episodes have fed (learned from what they sent,
    since only the generate function knows whom it calls), its own policy's room for adopted groups (its buffer's
    last lease answer), and while one it feeds has none, the hold-back: its training episodes wait unleased, which
    loses nothing (the prompts stay in the data, nothing is generated to be dropped) where stopping an episode half
    way would lose the host's turns too. Until its first episode sent something a lane holds nothing back; the
    groups that arrive over the bound meanwhile are trained all the same (`actors.buffer.adoption`)."""

    log: Any  # the lane's
    fed: set[str] = field(default_factory=set)
    room: int | None = None  # None: no bound (or not heard yet)
    holds: int = 0  # how often the lane started holding back
    held_s: float = 0.0  # for how long, the current hold included in `metrics`
    since: float | None = None  # the current hold's start

    def held_back(self, rooms: Mapping[str | None, int | None], waits: Any) -> bool:
        """Whether the lane's training episodes wait now (`rooms`: every lane's policy -> its room); a hold's start
        and end are logged, and it stays open in the hang report meanwhile, naming whom it waits for."""
        full = sorted(policy for policy in self.fed if rooms.get(policy) == 0)
        now = time.monotonic()
        if full and self.since is None:
            self.since, self.holds = now, self.holds + 1
            self.log.info("episodes held back: the adopted backlog of a policy they feed is at its bound "
                          "(--max-adopted-waiting)", feeds=full)
        elif not full and self.since is not None:
            self.held_s += now - self.since
            self.since = None
            self.log.info("episodes resume: the policies they feed have room again")
        if full:
            waits.begin(self, f"buffer@{full[0]}", f"room for the groups of episodes feeding {', '.join(full)} "
                                                  "(adopted backlog at --max-adopted-waiting)")
        else:
            waits.end(self)
        return bool(full)

    def metrics(self, policy: str) -> dict[str, float]:
        """How often and how long the lane of `policy` held its episodes back: why that policy slowed down."""
        held = self.held_s + (time.monotonic() - self.since if self.since is not None else 0.0)
        return {f"rollout.held_back.{policy}": float(self.holds), f"rollout.held_back_s.{policy}": held}
