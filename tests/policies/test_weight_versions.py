import pytest

from policies.weight_versions import LearnerVersions, PushLedger


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


# ------------------------------------------------------------------------------------ the pushes the learner owes
@pytest.mark.unit
def test_a_joining_engine_is_owed_a_push_before_the_next_batch_and_one_joining_during_it_another() -> None:
    pushes = PushLedger()
    assert not pushes.owed_between_steps()
    pushes.engines_joined = True
    assert pushes.owed_between_steps()
    pushes.owed_push_starting()
    pushes.engines_joined = True  # joined while that push ran: it may not have been among its engines
    pushes.push_ended(reached_every_engine=True)
    assert pushes.owed_between_steps()


@pytest.mark.unit
def test_a_push_held_for_an_eval_round_stays_owed_until_a_push_reaches_every_engine() -> None:
    pushes = PushLedger(held_for_eval=True)
    assert pushes.owed_between_steps()
    pushes.push_ended(reached_every_engine=False)
    assert pushes.held_for_eval and pushes.owed_on_empty_batch()
    pushes.push_ended(reached_every_engine=True)
    assert not pushes.owed_between_steps() and not pushes.owed_on_empty_batch()


@pytest.mark.unit
def test_a_failed_push_is_owed_only_when_the_buffer_answers_empty_not_before_every_batch() -> None:
    pushes = PushLedger()
    pushes.push_ended(reached_every_engine=False)
    assert pushes.owed_on_empty_batch() and not pushes.owed_between_steps()


@pytest.mark.unit
@pytest.mark.parametrize(("announced", "current", "again"), [
    ((4, 3), 4, True),  # announced before its weights landed: heard again with them
    (None, 4, True),  # the announcement was tried and not taken
    ((4, 4), 4, False),  # already heard with its weights
    ((4, 3), 5, False),  # the learner moved on: the next announcement carries these weights
])
def test_a_version_announced_without_its_weights_is_announced_again_once_they_land(
        announced: tuple[int, int] | None, current: int, again: bool) -> None:
    pushes = PushLedger()
    pushes.announcement_sent(4)
    if announced is not None:
        pushes.announcement_taken(*announced)
    assert pushes.announce_again(pushed=4, current=current, committed=4) is again
