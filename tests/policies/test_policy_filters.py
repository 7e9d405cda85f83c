import pytest

from policies.filters import FilterGroup, FilterVerdict, apply_filters


@pytest.mark.unit
def test_nonzero_std_drops_groups_whose_rewards_are_all_equal() -> None:
    assert apply_filters(["nonzero_std"], FilterGroup(rewards=[1.0, 1.0, 1.0])) == FilterVerdict(False, "zero_std")
    assert apply_filters(["nonzero_std"], FilterGroup(rewards=[1.0, 0.0, 1.0])).keep


@pytest.mark.unit
def test_no_reward_errors_drops_groups_with_a_failed_reward() -> None:
    group = FilterGroup(rewards=[1.0, None], statuses=["ok", "error"])
    assert apply_filters(["no_reward_errors"], group) == FilterVerdict(False, "reward_error")


@pytest.mark.unit
def test_first_dropping_filter_gives_the_reason() -> None:
    group = FilterGroup(rewards=[0.0, 0.0])
    verdict = apply_filters(["no_reward_errors", "nonzero_std", lambda g: False], group)
    assert verdict == FilterVerdict(False, "zero_std")


@pytest.mark.unit
def test_user_filter_returning_bool_is_named_as_the_reason() -> None:
    def too_short(group: FilterGroup) -> bool:
        return len(group.rewards) >= 3

    assert apply_filters([too_short], FilterGroup(rewards=[1.0, 0.0])) == FilterVerdict(False, "too_short")


@pytest.mark.unit
def test_filter_that_raises_drops_the_group_instead_of_crashing() -> None:
    def broken(group: FilterGroup) -> bool:
        raise KeyError("score")

    assert apply_filters([broken], FilterGroup(rewards=[1.0, 0.0])) == FilterVerdict(False, "filter_error:broken")
