"""The weight-version rule: which weights may generate training samples, and which pushes the learner still owes.

Every role reads the learner's versions; two pure objects hold what they know of them, so no role keeps loose
flags that another role must mirror. `LearnerVersions` is the listeners' side
(the rollout worker and the buffer read an announcement the same way, so they agree on which engine is too old);
`PushLedger` is the learner's (a push owed to a joining engine, to an evaluation hold that ended, to a push that
failed, and an announcement that went out without its weights). Neither does any I/O: the roles tell them what
happened and ask them what to do, and the unit tests walk every transition without a process.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LearnerVersions", "PushLedger"]


@dataclass
class LearnerVersions:
    """What a rollout worker (or the buffer) has heard of the learner's versions, and the rule that follows from it:
    whether an engine's weights are too old to generate training samples with. One object for both, so the two
    read an announcement the same way.

    A learner that pushes no weights (``--debug-rollout-only``: its announcements carry no weights version) leaves
    every engine on its first weights, and nothing is ever too old for it.
    """

    announced: int = 0  # the learner's version, as last announced (or as a lease was admitted at, if newer)
    pushed: int = 0  # the newest weights the learner has pushed to every engine
    learner_pushes: bool = False  # its announcements carry a weights version

    def heard(self, version: int, weights_version: int | None) -> None:
        """An announcement. The version is taken as it is (a learner restarted from a checkpoint announces a lower
        one); the pushed weights only move forward."""
        if weights_version is not None:
            self.pushed = max(self.pushed, weights_version)
            self.learner_pushes = True
        self.announced = version

    def leased_at(self, version: int) -> None:
        """A lease admitted at `version`: the buffer may have heard the announcement before this worker did."""
        if self.learner_pushes:
            self.announced = max(self.announced, version)

    def too_old(self, engine_version: int, max_staleness: int) -> bool:
        """Whether samples from weights `engine_version` would be older than anything the buffer accepts."""
        return engine_version < self.oldest_accepted(max_staleness)

    def oldest_accepted(self, max_staleness: int) -> int:
        """The oldest weights version whose samples the buffer still accepts (0: any)."""
        newest = max(self.pushed, self.announced if self.learner_pushes else 0)
        return max(0, newest - max_staleness)



@dataclass
class PushLedger:
    """The pushes the learner owes beyond each step's own, and whether its last announcement lacked its weights.

    A push goes to every engine, so the owed ones wait while an evaluation round holds the engines on its version
    (the learner asks its `EvalHold` first). An engine that joins during a push is owed another: the push that was
    already under way may have listed the engines before it joined.
    """

    engines_joined: bool = False  # an engine (re)joined since the last owed push began: it serves no current weights
    held_for_eval: bool = False  # a step's push was skipped to keep the engines on a version under evaluation
    failed: bool = False  # the last push did not reach every engine
    announcing: int | None = None  # the version last announced, or tried
    announced: tuple[int, int | None] | None = None  # (version, weights version) the controller last took

    def owed_between_steps(self) -> bool:
        """A push due before the next batch: a new engine must not wait a whole step, nor must a held push."""
        return self.engines_joined or self.held_for_eval

    def owed_push_starting(self) -> None:
        self.engines_joined = self.held_for_eval = False

    def owed_on_empty_batch(self) -> bool:
        """A failed push is retried whenever the buffer answers a batch request empty: the workers generate
        nothing older than the staleness bound allows, so that batch may be waiting for these very weights."""
        return self.failed

    def push_ended(self, *, reached_every_engine: bool) -> None:
        self.failed = not reached_every_engine
        if reached_every_engine:
            self.held_for_eval = False

    def announcement_sent(self, version: int) -> None:
        self.announcing = version

    def announcement_taken(self, version: int, weights_version: int | None) -> None:
        self.announced = (version, weights_version)

    def announce_again(self, *, pushed: int, current: int, committed: int | None) -> bool:
        """After a push of `pushed` reached every engine: whether the version announced (or tried) before its
        weights landed must be announced again, so every role hears it with its weights, not a step later or
        never. Not once the learner moved past it: the next announcement carries these weights anyway."""
        return current == pushed == self.announcing and self.announced != (pushed, committed)
