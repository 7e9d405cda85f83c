from __future__ import annotations

import pytest

from policies.weight_versions import NOTHING, Hold, LearnerVersions, Push, WeightCadence


# ------------------------------------------------------------------------------- what the roles hear of versions
@pytest.mark.unit
def test_an_engine_is_too_old_once_the_learner_has_moved_past_its_weights_by_more_than_the_bound() -> None:
    heard = LearnerVersions()
    heard.heard(version=3, weights_version=2)
    assert heard.learner_pushes and (heard.announced, heard.pushed) == (3, 2)
    assert not heard.too_old(engine_version=2, max_staleness=1)
    assert heard.too_old(engine_version=1, max_staleness=1)  # 1 + 1 < 3: the buffer would evict its samples
    assert heard.too_old(engine_version=2, max_staleness=0)  # synchronous: announced, weights not landed yet
    # what another worker's engine must serve for this worker's router to send it training calls
    assert (heard.oldest_accepted(max_staleness=1), heard.oldest_accepted(max_staleness=5)) == (2, 0)


@pytest.mark.unit
def test_a_learner_that_pushes_nothing_never_makes_an_engine_too_old() -> None:
    heard = LearnerVersions()
    heard.heard(version=50, weights_version=None)  # --debug-rollout-only: the version is a label
    heard.leased_at(60)
    assert not heard.learner_pushes and not heard.too_old(engine_version=0, max_staleness=0)


@pytest.mark.unit
def test_pushed_weights_only_move_forward_and_a_restarted_learner_announces_lower() -> None:
    heard = LearnerVersions()
    heard.heard(version=8, weights_version=8)
    heard.heard(version=5, weights_version=5)  # restarted from its step-5 checkpoint
    assert (heard.announced, heard.pushed) == (5, 8)
    heard.leased_at(7)  # the buffer heard of version 7 first
    assert heard.announced == 7
    heard.leased_at(6)
    assert heard.announced == 7


# ------------------------------------------------------------------------------------- when the learner pushes
class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def cadence(**state: object) -> WeightCadence:
    return WeightCadence(hold_timeout_s=60.0, clock=Clock(), **state)


def pinned_on(version: int, **state: object) -> WeightCadence:
    pinned = cadence(**state)
    pinned.pin(version)
    pinned.push_ended(version, reached_every_engine=True)
    assert pinned.holding() == version
    return pinned


def failed_while_pinned_on(version: int) -> WeightCadence:
    pinned = pinned_on(version)
    pinned.push_ended(version + 1, reached_every_engine=False)
    return pinned


@pytest.mark.unit
@pytest.mark.parametrize(("name", "build", "ask", "expected"), [
    ("a step pushes its version", cadence, lambda c: c.after_step(3), Push()),
    ("not between the interval's versions", lambda: cadence(update_interval=2), lambda c: c.after_step(3),
     NOTHING),
    ("on the interval's versions", lambda: cadence(update_interval=2), lambda c: c.after_step(4), Push()),
    ("a step's push waits while the engines are pinned", lambda: pinned_on(2), lambda c: c.after_step(3),
     Hold(2, step_push=True)),
    ("nothing is owed between steps at first", cadence, lambda c: c.between_steps(), NOTHING),
    ("an engine that joined is owed a push before the next batch", lambda: cadence(engines_joined=True),
     lambda c: c.between_steps(), Push(owed=True)),
    ("...but not while the engines are pinned", lambda: pinned_on(2, engines_joined=True),
     lambda c: c.between_steps(), Hold(2)),
    ("a held step's push is owed before the next batch", lambda: cadence(step_push_held=True),
     lambda c: c.between_steps(), Push(owed=True)),
    ("an empty batch retries nothing after a push that reached every engine", cadence,
     lambda c: c.on_empty_batch(), NOTHING),
    ("an empty batch retries a failed push", lambda: cadence(failed=True), lambda c: c.on_empty_batch(), Push()),
    ("...unless pinned", lambda: failed_while_pinned_on(2), lambda c: c.on_empty_batch(), Hold(2)),
    ("the final push waits for the pin", lambda: pinned_on(4), lambda c: c.final(), Hold(4)),
    ("the final push goes when nothing pins", cadence, lambda c: c.final(), Push()),
])
def test_the_cadence_answers(name: str, build: object, ask: object, expected: object) -> None:
    assert ask(build()) == expected, name  # type: ignore[operator]


@pytest.mark.unit
def test_a_pin_is_taken_on_the_first_weights_of_its_version_or_newer_that_reach_every_engine() -> None:
    weights = cadence()
    weights.pin(4)
    weights.push_ended(3, reached_every_engine=True)
    assert weights.holding() is None
    weights.push_ended(5, reached_every_engine=False)
    assert weights.holding() is None  # not every engine has 5
    weights.push_ended(5, reached_every_engine=True)
    assert weights.holding() == 5 and weights.after_step(6) == Hold(5, step_push=True)
    weights.pin(6)  # asked again while taken: nothing changes (the asker polls)
    assert weights.holding() == 5


@pytest.mark.unit
def test_a_pin_asked_for_weights_the_engines_already_serve_is_taken_at_once_unless_a_push_is_under_way() -> None:
    weights = cadence()
    weights.push_ended(2, reached_every_engine=True)
    weights.push_started()
    weights.pin(0)
    assert weights.holding() is None  # the engines may be between 2 and the next version
    weights.push_ended(3, reached_every_engine=True)
    assert weights.holding() == 3
    weights.release(3)
    weights.pin(3)
    assert weights.holding() is None  # released: 3 is not pinned again
    weights.pin(2)
    assert weights.holding() is None


@pytest.mark.unit
def test_one_request_releases_a_pin_and_arms_the_next_so_no_push_slips_between() -> None:
    weights = pinned_on(2)
    weights.release(2)
    weights.pin(4)
    assert weights.after_step(3) == Push()
    weights.push_ended(3, reached_every_engine=True)
    assert weights.holding() is None
    weights.push_ended(4, reached_every_engine=True)
    assert weights.holding() == 4


@pytest.mark.unit
@pytest.mark.parametrize(("released", "pinned"), [(-1, 7), (7, None)])
def test_the_final_version_is_pinned_when_training_ends_unless_already_released(
        released: int, pinned: int | None) -> None:
    weights = cadence()
    weights.release(released)
    weights.pin(10, final=True)
    weights.push_ended(7, reached_every_engine=True)
    assert weights.holding() is None
    weights.finishing(7)
    assert weights.holding() == pinned


@pytest.mark.unit
def test_a_pin_not_released_in_time_lets_the_next_push_go_and_says_which_version_it_let_go() -> None:
    weights = pinned_on(2)
    weights.clock.now = 61.0  # type: ignore[attr-defined]
    decision = weights.after_step(3)
    assert decision == Push(expired_hold=2)
    weights.acted(decision)
    assert weights.pinned is None and weights.after_step(3) == Push()


@pytest.mark.unit
def test_a_held_step_push_stays_owed_until_a_push_reaches_every_engine() -> None:
    weights = pinned_on(2)
    weights.acted(weights.after_step(3))
    weights.release(2)
    assert weights.between_steps() == Push(owed=True)
    weights.acted(Push(owed=True))
    weights.push_ended(3, reached_every_engine=False)
    assert weights.on_empty_batch() == Push() and weights.between_steps() == NOTHING
    weights.step_push_held = True  # held again (a later pin) and not pushed yet
    weights.push_ended(3, reached_every_engine=True)
    assert weights.between_steps() == NOTHING and weights.on_empty_batch() == NOTHING


@pytest.mark.unit
def test_an_engine_joining_during_an_owed_push_is_owed_another() -> None:
    weights = cadence()
    weights.on_engine_joined()
    weights.acted(weights.between_steps())
    assert weights.between_steps() == NOTHING
    weights.on_engine_joined()  # joined while that push ran: it may not have been among its engines
    weights.push_ended(1, reached_every_engine=True)
    assert weights.between_steps() == Push(owed=True)


@pytest.mark.unit
@pytest.mark.parametrize(("announced", "current", "again"), [
    ((4, 3), 4, True),  # announced before its weights landed: heard again with them
    (None, 4, True),  # the announcement was tried and not taken
    ((4, 4), 4, False),  # already heard with its weights
    ((4, 3), 5, False),  # the learner moved on: the next announcement carries these weights
])
def test_a_version_announced_without_its_weights_is_announced_again_once_they_land(
        announced: tuple[int, int] | None, current: int, again: bool) -> None:
    weights = WeightCadence()
    weights.announcement_sent(4)
    if announced is not None:
        weights.announcement_taken(*announced)
    assert weights.announce_again(pushed=4, current=current, committed=4) is again


@pytest.mark.unit
def test_weights_the_engines_load_themselves_can_be_pinned_before_any_push() -> None:
    """A fresh run's engines start from the learner's version 0: the baseline round pins them there, even when the
    learner's first push found no engine yet."""
    weights = cadence()
    weights.engines_serve(0)
    weights.push_ended(0, reached_every_engine=False)
    weights.pin(0)
    assert weights.holding() == 0 and weights.after_step(1) == Hold(0, step_push=True)


@pytest.mark.unit
def test_in_a_run_with_a_role_that_pins_nothing_is_pushed_before_its_first_ask() -> None:
    """The evaluator may start after the learner's first step: its baseline round's version 0 must still be on
    the engines when it asks, so that step's push waits for the ask (and only for the ask: `None` pins nothing)."""
    weights = cadence()
    weights.engines_serve(0)
    weights.expect_pins()
    assert weights.holds_pushes() and weights.holding() is None
    decision = weights.after_step(1)
    assert decision == Hold(None, step_push=True)
    weights.acted(decision)
    assert weights.between_steps() == Hold(None)  # the held push stays owed, and held
    weights.pin(0)  # the first ask: the engines still serve 0, so the pin is taken at once
    assert weights.holding() == 0 and weights.between_steps() == Hold(0)
    weights.release(0)
    assert not weights.holds_pushes() and weights.between_steps() == Push(owed=True)

    resumed = cadence()
    resumed.expect_pins()
    resumed.pin(None)  # a first ask that pins nothing lets the pushes go
    assert not resumed.holds_pushes() and resumed.after_step(5) == Push()


@pytest.mark.unit
def test_a_first_ask_that_never_comes_holds_the_pushes_only_until_the_pin_deadline() -> None:
    weights = cadence()
    weights.expect_pins()
    assert weights.after_step(1) == Hold(None, step_push=True)
    weights.clock.now = 61.0  # type: ignore[attr-defined]
    assert not weights.holds_pushes() and weights.after_step(1) == Push()
