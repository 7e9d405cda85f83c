"""The weight-version rule: which weights may generate training samples, and which pushes the learner still owes.

Every role reads the learner's versions; two pure objects hold what they know of them, so no role keeps loose
flags that another role must mirror. `LearnerVersions` is the listeners' side
(the rollout worker and the buffer read an announcement the same way, so they agree on which engine is too old);
`WeightCadence` is the learner's (when to push: after a step, to a joining engine, after a push that failed, never
while the engines are pinned on a version; and an announcement that went out without its weights). Neither does
any I/O: the roles tell them what happened and ask them what to do, and the unit tests walk every transition
without a process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["NOTHING", "Decision", "Hold", "LearnerVersions", "Nothing", "Push", "WeightCadence"]


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


@dataclass(frozen=True)
class Push:
    """Push the current version's weights to every engine.

    `owed`: the push clears what was owed between steps (an engine that joined, a step's push that was held);
    `expired_hold`: the version the engines were held on, let go because its release did not come in time."""

    owed: bool = False
    expired_hold: int | None = None


@dataclass(frozen=True)
class Hold:
    """A push is due but the engines are pinned on `version` until it is released, or (None) a role that pins has
    not asked yet (`WeightCadence.expect_pins`): push nothing now. `step_push`: it was a step's own push, owed from
    now on until a push reaches every engine."""

    version: int | None
    step_push: bool = False


@dataclass(frozen=True)
class Nothing:
    """No push is due."""


Decision = Push | Hold | Nothing
NOTHING = Nothing()


@dataclass
class WeightCadence:
    """When the learner pushes weights: after every `update_interval`-th step, before the next batch when a push is
    owed (an engine joined, a step's push was held), after an empty batch when the last push failed; and never while
    the engines are pinned on a version that has not been released (its evaluation is still being generated).

    The questions (`after_step`, `between_steps`, `on_empty_batch`, `final`) only read; the learner tells the
    cadence what it did (`acted`, `push_started`) and what happened (`on_engine_joined`, `push_ended`, `pin`,
    `release`, `finishing`), so every transition is a unit test without a process.

    A pin is asked for ahead (`pin(at_least)`: another role, the evaluator, wants the engines held on the first
    weights of that version or newer) and taken when such weights reach every engine (at once if they already
    serve them and no push is under way); with `final`, also on the run's last version when training ends
    (`finishing`). It lets go on `release` of that version or a later one, or `hold_timeout_s` after it was taken.
    In a run with such a role (`expect_pins`), nothing is pushed before its first ask, so the first version it
    asks for (a fresh run's 0) cannot have left the engines while it started.

    The announcement half: whether the version announced before its weights landed must be announced again.
    """

    update_interval: int = 1
    hold_timeout_s: float = 300.0
    clock: Callable[[], float] = time.monotonic
    engines_joined: bool = False  # an engine (re)joined since the last owed push began: it serves no current weights
    step_push_held: bool = False  # a step's push was skipped to keep the engines on a pinned version
    failed: bool = False  # the last push did not reach every engine
    pushing: bool = False  # a push is under way: the engines may be between two versions
    last_pushed: int | None = None  # the newest version a push brought to every engine
    armed: int | None = None  # pin the first weights of this version or newer the engines get
    armed_final: bool = False  # pin the run's last version when training ends
    pinned: int | None = None  # the version the engines are held on
    released_through: int = -1  # every pin of a version up to this one is released
    pin_deadline: float = 0.0
    first_ask_by: float | None = None  # expect_pins: no push before the first `pin`, or until this clock time
    announcing: int | None = None  # the version last announced, or tried
    announced: tuple[int, int | None] | None = None  # (version, weights version) the controller last took

    # ------------------------------------------------------------------------------------- the questions
    def after_step(self, version: int) -> Decision:
        """A step left `version`: push every `update_interval`-th version, unless pinned."""
        if version % self.update_interval:
            return NOTHING
        return self._unless_pinned(step_push=True)

    def between_steps(self) -> Decision:
        """Before the next batch: a new engine must not wait a whole step, nor must a held push. A push goes to
        every engine, so while pinned the newcomer waits for the release too."""
        if not (self.engines_joined or self.step_push_held):
            return NOTHING
        return self._unless_pinned(owed=True)

    def on_empty_batch(self) -> Decision:
        """A failed push is tried again whenever the buffer answers a batch request empty: the workers generate
        nothing older than the staleness bound allows, so that batch may be waiting for these very weights."""
        if not self.failed:
            return NOTHING
        return self._unless_pinned()

    def final(self) -> Decision:
        """The last version's weights, once nothing pins the engines: the final evaluation must see them."""
        return self._unless_pinned()

    def holding(self) -> int | None:
        """The version the engines are pinned on now (None: free to move)."""
        if self.pinned is None or self.pinned <= self.released_through or self.clock() > self.pin_deadline:
            return None
        return self.pinned

    def holds_pushes(self) -> bool:
        """Whether a push due now would be held: a pin, or a first ask still awaited."""
        return self.holding() is not None or self._awaiting_first_ask()

    def _awaiting_first_ask(self) -> bool:
        return self.first_ask_by is not None and self.clock() <= self.first_ask_by

    def _unless_pinned(self, *, owed: bool = False, step_push: bool = False) -> Decision:
        held = self.holding()
        if held is not None or self._awaiting_first_ask():
            return Hold(held, step_push=step_push)
        expired = self.pinned if self.pinned is not None and self.pinned > self.released_through else None
        return Push(owed=owed, expired_hold=expired)

    # ---------------------------------------------------------------------------------------- the events
    def acted(self, decision: Decision) -> None:
        """The learner does what `decision` says (a push starts now)."""
        if isinstance(decision, Hold) and decision.step_push:
            self.step_push_held = True
        elif isinstance(decision, Push):
            if decision.owed:
                self.engines_joined = self.step_push_held = False
            if decision.expired_hold is not None:
                self.pinned = None

    def on_engine_joined(self) -> None:
        """An engine (re)joined: it is owed the current weights before the next batch (`between_steps`), even one
        that joined while a push ran, since that push may have listed the engines before it joined."""
        self.engines_joined = True

    def engines_serve(self, version: int) -> None:
        """The engines have `version` without a push (a fresh run: they load the learner's first weights
        themselves), so a pin asked for it is taken at once."""
        if self.last_pushed is None:
            self.last_pushed = version

    def push_started(self) -> None:
        self.pushing = True

    def push_ended(self, version: int, *, reached_every_engine: bool) -> None:
        self.pushing = False
        self.failed = not reached_every_engine
        if not reached_every_engine:
            return
        self.step_push_held = False
        self.last_pushed = version if self.last_pushed is None else max(self.last_pushed, version)
        if self.armed is not None and version >= self.armed:
            self._take(version)

    def expect_pins(self) -> None:
        """A role of this run will ask for pins: push nothing until its first ask (`pin`, whatever it asks), or for
        `hold_timeout_s` if it never comes."""
        self.first_ask_by = self.clock() + self.hold_timeout_s

    def pin(self, at_least: int | None, *, final: bool = False) -> None:
        """Hold the engines on the first weights of version `at_least` or newer they get; with `final`, on the
        run's last version too. Asking again changes nothing once the pin is taken (the asker polls)."""
        self.first_ask_by = None
        if self.pinned is not None and self.holding() is not None:
            return
        self.armed, self.armed_final = at_least, final
        serving = self.last_pushed
        if at_least is not None and not self.pushing and serving is not None and serving >= at_least:
            self._take(serving)

    def finishing(self, version: int) -> None:
        """Training is over at `version` (its weights pushed, if the learner pushes): pin it if the final version
        was asked for. The learner ends the run once nothing is pinned."""
        if self.armed_final and self.holding() is None:
            self._take(version)

    def _take(self, version: int) -> None:
        if version <= self.released_through:
            return
        self.pinned, self.armed = version, None
        self.pin_deadline = self.clock() + self.hold_timeout_s

    def release(self, through: int) -> None:
        """Every pin of a version up to `through` may go (what was to be generated on it is done)."""
        self.released_through = max(self.released_through, through)
        if self.pinned is not None and self.pinned <= self.released_through:
            self.pinned = None

    # ----------------------------------------------------------------------------------- the announcements
    def announcement_sent(self, version: int) -> None:
        self.announcing = version

    def announcement_taken(self, version: int, weights_version: int | None) -> None:
        self.announced = (version, weights_version)

    def announce_again(self, *, pushed: int, current: int, committed: int | None) -> bool:
        """After a push of `pushed` reached every engine: whether the version announced (or tried) before its
        weights landed must be announced again, so every role hears it with its weights, not a step later or
        never. Not once the learner moved past it: the next announcement carries these weights anyway."""
        return current == pushed == self.announcing and self.announced != (pushed, committed)
