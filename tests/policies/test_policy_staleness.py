import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.staleness import (
    AdmissionController,
    StaleAction,
    sample_staleness,
    split_by_staleness,
    staleness_histogram,
    staleness_of_range,
    staleness_of_samples,
    token_staleness,
    version_range,
)


def _simulate(
    eta: int, groups_per_batch: int, n_batches: int, seed: int, in_order: bool
) -> list[list[tuple[int, int]]]:
    """An eager fully-async run driven only by the admission rule.

    Returns, per trained batch, the ``(group number, version it started at)`` of its groups. Workers start as many
    groups as admission allows (a random share of it), groups finish in start order or shuffled, and the learner
    trains the first B finished groups whenever B are ready.
    """
    rng = random.Random(seed)
    controller = AdmissionController(max_staleness=eta, groups_per_batch=groups_per_batch)
    version, started = 0, 0
    in_flight: list[tuple[int, int]] = []
    finished: list[tuple[int, int]] = []
    batches: list[list[tuple[int, int]]] = []
    while len(batches) < n_batches:
        allowance = controller.capacity(learner_version=version, started_groups=started)
        for _ in range(rng.randint(1, allowance) if allowance else 0):
            in_flight.append((started, version))
            started += 1
        if not in_order:
            rng.shuffle(in_flight)
        n_done = rng.randint(1, len(in_flight)) if in_flight else 0
        finished += in_flight[:n_done]
        del in_flight[:n_done]
        if len(finished) >= groups_per_batch:
            batches.append(finished[:groups_per_batch])
            del finished[:groups_per_batch]
            version += 1
    return batches


@pytest.mark.unit
@settings(max_examples=40, deadline=None)
@given(groups_per_batch=st.integers(1, 6), seed=st.integers(0, 10**6), in_order=st.booleans())
def test_zero_staleness_admission_is_exactly_synchronous_batching(
    groups_per_batch: int, seed: int, in_order: bool
) -> None:
    batches = _simulate(0, groups_per_batch, n_batches=6, seed=seed, in_order=in_order)
    for version, batch in enumerate(batches):
        # batch v holds exactly the groups numbered vB .. (v+1)B-1, all started while the learner was at v
        assert sorted(number for number, _ in batch) == list(
            range(version * groups_per_batch, (version + 1) * groups_per_batch)
        )
        assert all(started_at == version for _, started_at in batch)


@pytest.mark.unit
@settings(max_examples=40, deadline=None)
@given(eta=st.integers(0, 4), groups_per_batch=st.integers(1, 5), seed=st.integers(0, 10**6))
def test_in_order_consumption_never_exceeds_the_bound(eta: int, groups_per_batch: int, seed: int) -> None:
    batches = _simulate(eta, groups_per_batch, n_batches=3 * (eta + 2), seed=seed, in_order=True)
    staleness = [version - started_at for version, batch in enumerate(batches) for _, started_at in batch]
    assert max(staleness) <= eta


@pytest.mark.unit
def test_out_of_order_completion_can_exceed_the_bound_and_the_consumption_check_catches_it() -> None:
    controller = AdmissionController(max_staleness=1, groups_per_batch=1)
    assert controller.capacity(learner_version=0, started_groups=0) == 2  # g0 (slow) and g1 start at version 0
    # g1 trains at v0; then g2 (started v1) at v1 and g3 (started v2) at v2; g0 finally arrives at v3
    assert controller.capacity(learner_version=1, started_groups=2) == 1
    assert controller.capacity(learner_version=2, started_groups=3) == 1
    staleness = sample_staleness(3, torch.tensor([0, 0, 3]), torch.tensor([2, 1]))  # g0 then a fresh sample
    split = split_by_staleness(staleness, max_staleness=1, action="release")
    assert split.stale.tolist() == [0] and split.fresh.tolist() == [1] and split.action is StaleAction.RELEASE


@pytest.mark.unit
def test_capacity_is_budget_minus_live_groups_and_gives_dropped_groups_back() -> None:
    controller = AdmissionController(max_staleness=2, groups_per_batch=4)
    assert controller.budget(learner_version=1) == 16
    assert controller.capacity(learner_version=1, started_groups=14) == 2
    assert controller.capacity(learner_version=1, started_groups=14, dropped_groups=3) == 5
    assert controller.capacity(learner_version=1, started_groups=30) == 0
    assert not controller.may_start(learner_version=1, started_groups=16)


@pytest.mark.unit
def test_admission_rejects_nonsense_counts() -> None:
    with pytest.raises(ValueError, match="max_staleness: must be >= 0"):
        AdmissionController(max_staleness=-1, groups_per_batch=1)
    with pytest.raises(ValueError, match=r"dropped_groups \(5\) <= started_groups \(2\)"):
        AdmissionController(max_staleness=0, groups_per_batch=1).capacity(
            learner_version=0, started_groups=2, dropped_groups=5
        )


@pytest.mark.unit
def test_sample_staleness_is_decided_by_the_oldest_token() -> None:
    # a weight update landed mid-generation in sample 0 (tokens from versions 3 and 4)
    versions = torch.tensor([3, 3, 4, 4, 5, 5])
    staleness = sample_staleness(5, versions, torch.tensor([4, 2]))
    assert staleness.tolist() == [2, 0]
    assert token_staleness(5, versions).tolist() == [2, 2, 1, 1, 0, 0]


@pytest.mark.unit
def test_a_token_newer_than_a_restarted_learner_is_as_stale_as_its_distance() -> None:
    # the learner restarted from the checkpoint at version 5; the engines had already served version 7
    assert token_staleness(5, torch.tensor([4, 7, 5])).tolist() == [1, 2, 0]
    assert sample_staleness(5, torch.tensor([7, 7, 4, 6]), torch.tensor([2, 2])).tolist() == [2, 1]


@pytest.mark.unit
def test_staleness_of_samples_takes_each_samples_own_versions() -> None:
    old, mixed, future = np.array([3, 4], dtype=np.int32), np.array([5, 4, 5], dtype=np.int32), np.array([8], np.int32)
    future.setflags(write=False)  # as received from the wire
    assert staleness_of_samples(5, [old, mixed, None, future]) == [2, 1, 0, 3]
    assert staleness_of_samples(5, []) == []


@pytest.mark.unit
@settings(max_examples=200, deadline=None)
@given(learner=st.integers(0, 50),
       samples=st.lists(st.one_of(st.none(), st.lists(st.integers(0, 50), max_size=6)), max_size=5))
def test_a_version_range_measures_a_group_as_its_tokens_do(learner: int, samples: list[list[int] | None]) -> None:
    """The buffer keeps only (oldest, newest) per group; the farthest token must still decide."""
    arrays = [None if s is None else np.array(s, dtype=np.int32) for s in samples]
    per_token = [learner - v if learner >= v else v - learner for s in samples if s for v in s]
    assert staleness_of_range(learner, version_range(arrays)) == max(per_token, default=0)
    assert max(staleness_of_samples(learner, arrays), default=0) == max(per_token, default=0)


@pytest.mark.unit
def test_float_token_versions_are_refused() -> None:
    with pytest.raises(ValueError, match="expected integers"):
        version_range([np.array([4.0])])
    with pytest.raises(ValueError, match="expected an integer tensor"):
        token_staleness(5, torch.tensor([4.0]))


@pytest.mark.unit
def test_staleness_histogram_counts_each_value() -> None:
    assert staleness_histogram(torch.tensor([0, 2, 0, 1, 0])) == {0: 3, 1: 1, 2: 1}
    assert staleness_histogram([]) == {}
