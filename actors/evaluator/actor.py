"""Evaluator: pin a due version on the engines, have its round generated and scored, write it, release the pin.

Started on the head node when the run has eval data and an eval interval (`--eval-prompt-data`, `--eval-interval`).
The other roles know nothing of evaluation: the learner holds its pushes while a version is pinned (`WeightPin`),
the buffer leases the groups this role owns ahead of training prompts and passes their scored groups back
(`GuestGroups`, `PromptGroup.owner`), and the rollout and reward workers generate and score them like any group.

A kill -9 loses nothing: the learner keeps the pin (until --final-eval-timeout), `metrics/eval.jsonl` says which
rounds were written, and the restarted evaluator asks for the pin again, starts the round that was open and hands
its groups to the buffer again (the buffer keeps one copy of a group queued or in flight).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from pathlib import Path

from actors.evaluator.gains import SCORES_FILE, first_rounds
from actors.evaluator.rounds import EvalRounds, eval_due, next_due
from actors.extensions.load import eval_log_hook
from actors.runtime.base import Actor
from actors.runtime.checkpoint_pointer import latest_checkpoint, resume_source
from actors.runtime.context import ActorContext
from actors.runtime.handlers import handles, on_broadcast
from actors.runtime.metrics import MetricsWriter, read_metrics
from bus.schema import (
    TOPIC_VERSION,
    GuestGroups,
    PromptGroup,
    ScoredGroup,
    VersionAnnouncement,
    WeightPin,
    WeightPinState,
)

POLL_S = 0.5  # how often the learner is asked for the pin while none is taken
HAND_OVER_AGAIN_S = 10.0  # an open round's unscored groups go to the buffer again this often (a lost result)


class Evaluator(Actor):
    role = "evaluator"

    def __init__(self, context: ActorContext) -> None:
        super().__init__(context)
        self.writer: MetricsWriter | None = None
        self.scores_writer: MetricsWriter | None = None

    async def on_start(self) -> None:
        self.config = self.settings.run
        self.writer = self.open_metrics("eval")
        self.queue: deque[PromptGroup] = deque()  # a started round's groups, until the buffer has them
        self.scores_writer = self.open_metrics(SCORES_FILE)
        self.rounds = EvalRounds(self.config, self.queue, self.writer, self.log, owner=self.role,
                                 log_hook=eval_log_hook(self.config, self.log, self.counters),
                                 scores_writer=self.scores_writer)
        self.rounds.reported = written_rounds(self.context.run_dir / "metrics" / "eval.jsonl")
        self.rounds.baselines = first_rounds(self.scores_writer.path)
        self.evaluated = max((version for version, _ in self.rounds.reported), default=None)
        learner = self.config.learner
        # A fresh run: the learner starts at version 0, which the engines load themselves.
        self.fresh = not self.rounds.reported and latest_checkpoint(
            resume_source(learner.load, learner.save, self.context.run_dir)) is None
        self.learner = self.peer_rpc("learner")
        self.buffer = self.peer_rpc("buffer")
        self.publishes: bool | None = None  # whether the learner pushes weights (from its first answer)
        self.learner_version: int | None = None  # as its first answer said: a resumed run evaluates from there on
        self.changed = asyncio.Event()  # a round finished, or a version was announced
        self.handed_over_at = 0.0

    async def run(self) -> None:
        """ask for the pin → start its round → hand its groups to the buffer → (rounds report) → release.

        A fresh run's baseline round starts at once, while the learner starts up: the engines serve version 0 from
        their own checkpoint, and the learner pins them there when asked (`WeightCadence.engines_serve`)."""
        if self.fresh and eval_due(self.config, 0):
            self.rounds.start(0, weights_version=0)
            await self.hand_over()
        while not self.stopping:
            state = await self.ask_for_pin()
            if state is not None and state.pinned is not None and not self.rounds.pending:
                self.rounds.start(state.pinned, weights_version=state.pinned if state.publishes else None)
            await self.hand_over()
            if state is not None and self.learner_version is None:
                self.learner_version = state.version
                continue  # now that it is known, ask for the first due version at once
            self.changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.changed.wait(), POLL_S)

    async def ask_for_pin(self) -> WeightPinState | None:
        """One request: release what is evaluated, and pin the next due version (and the final one)."""
        done = max(self.rounds.done_through, -1 if self.evaluated is None else self.evaluated)
        final = self.config.eval.final_eval_timeout > 0  # 0: no final round
        request = WeightPin(at_least=self.next_pin(), release_through=done, final=final)
        try:
            reply = await self.learner.call(request, timeout=5.0, retries=1)
        except (TimeoutError, asyncio.TimeoutError, ConnectionError):
            self.counters["pin.unanswered"] += 1
            return None
        if not isinstance(reply, WeightPinState):
            self.log.warning("unexpected answer to a weight pin", reply=repr(reply)[:200])
            return None
        self.publishes = reply.publishes
        return reply

    def next_pin(self) -> int | None:
        """The version to pin next: an open round's; else the first due after every round started (or written
        before a restart), or from the learner's version on when there is none. None for a learner that pushes
        nothing (rounds follow its announcements), and, with no round open, until the learner answered once. The
        learner pushes nothing before this role's first ask, so a round open then still finds its version."""
        if self.publishes is False:
            return None
        if self.rounds.pending:  # a fresh run's baseline round asks its version 0 in the very first request
            return min(version for version, _ in self.rounds.rounds)
        if self.learner_version is None:
            return None
        seen = [*self.rounds.started_versions, *([] if self.evaluated is None else [self.evaluated])]
        if seen:
            return next_due(self.config, max(seen))
        return next_due(self.config, self.learner_version - 1 if self.learner_version > 0 else None)

    async def hand_over(self) -> None:
        """The queued groups to the buffer, and, now and then, every open round's unscored groups again: a scored
        group that came back while this process was not there (or not yet tracking its round) is lost."""
        loop = asyncio.get_running_loop()
        if self.rounds.pending and loop.time() - self.handed_over_at > HAND_OVER_AGAIN_S:
            self.queue.clear()
            self.queue.extend(self.rounds.groups_pending())
        if not self.queue:
            return
        groups = list(self.queue)
        try:
            await self.buffer.call(GuestGroups(groups=groups), timeout=5.0, retries=1)
        except (TimeoutError, asyncio.TimeoutError, ConnectionError):
            self.counters["handover.unanswered"] += 1
            return
        self.queue.clear()
        self.handed_over_at = loop.time()
        self.counters["groups.handed_over"] += len(groups)

    @handles(ScoredGroup)
    async def on_scored(self, sender: str, group: ScoredGroup) -> None:
        open_rounds = len(self.rounds.rounds)
        self.rounds.record(group)
        self.counters["groups.scored"] += 1
        if len(self.rounds.rounds) < open_rounds:  # a round reported: release its pin now, not at the next poll
            self.changed.set()

    @on_broadcast(TOPIC_VERSION)
    async def on_version(self, topic: str, announcement: VersionAnnouncement) -> None:
        """New weights on the engines may be the ones pinned: ask now, not at the next poll. A learner that pushes
        no weights (--debug-rollout-only): its version is the round's label."""
        if announcement.policy != self.context.policy:
            return  # another policy's learner
        if announcement.weights_version is not None:
            self.changed.set()
        elif self.publishes is False:
            self.labelled(announcement.version)

    def labelled(self, version: int) -> None:
        if eval_due(self.config, version):
            self.rounds.start(version)
            self.changed.set()

    async def on_stop(self) -> None:
        for writer in (self.writer, self.scores_writer):
            if writer is not None:
                writer.close()


def written_rounds(path: Path) -> set[tuple[int, str]]:
    """The (version, set) of every round `metrics/eval.jsonl` holds: a restarted evaluator does not write them
    again."""
    written = set()
    for row in read_metrics(path):
        for key in row:
            parts = key.split("/")
            if len(parts) == 3 and parts[0] == "eval" and parts[2] == "mean_reward":
                written.add((int(row["step"]), parts[1]))
    return written
