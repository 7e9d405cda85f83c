"""The router's choice of engine (policies/routing.py): a consistent-hash ring that moves few keys when engines join
or leave, a load bound that spills a busy owner's keys to the next engine on the ring, and the plain policies."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from policies.routing import HashRing, bounded_load_choice, choose_engine, least_loaded

pytestmark = pytest.mark.unit

KEYS = [f"group-{group}/{index}" for group in range(2500) for index in range(4)]


def engines(count: int) -> list[str]:
    return [f"rollout-0-{index}" for index in range(count)]


def owners(ring: HashRing) -> dict[str, str]:
    return {key: ring.owner(key) for key in KEYS}


def test_every_worker_builds_the_same_ring_whatever_order_it_heard_of_the_engines() -> None:
    names = engines(5)
    assert owners(HashRing.of(names)) == owners(HashRing.of(reversed(names)))


def test_keys_spread_evenly_over_the_engines() -> None:
    for count in (4, 16):
        shares = Counter(owners(HashRing.of(engines(count))).values())
        fair = len(KEYS) / count
        assert set(shares) == set(engines(count))
        assert all(0.75 * fair <= share <= 1.25 * fair for share in shares.values()), shares


def test_an_engine_that_joins_takes_about_its_share_of_keys_and_no_other_key_moves() -> None:
    before, after = owners(HashRing.of(engines(4))), owners(HashRing.of(engines(5)))
    moved = [key for key in KEYS if before[key] != after[key]]
    assert {after[key] for key in moved} == {"rollout-0-4"}  # every moved key went to the new engine
    assert 0.15 < len(moved) / len(KEYS) < 0.25  # about 1/5, where rehashing modulo n would move 4/5


def test_an_engine_that_leaves_gives_up_only_its_own_keys_spread_over_the_rest() -> None:
    before, after = owners(HashRing.of(engines(5))), owners(HashRing.of(engines(5)[:-1]))
    moved = [key for key in KEYS if before[key] != after[key]]
    assert moved == [key for key in KEYS if before[key] == "rollout-0-4"]
    assert set(Counter(after[key] for key in moved)) == set(engines(4))


def test_a_walk_visits_every_engine_once_from_the_owner() -> None:
    ring = HashRing.of(engines(6))
    for key in KEYS[:50]:
        walk = ring.walk(key)
        assert walk[0] == ring.owner(key) and sorted(walk) == engines(6)


def test_bounded_load_keeps_the_owner_until_it_would_pass_the_bound_then_takes_the_next_on_the_ring() -> None:
    order = ["b", "c", "a"]
    assert bounded_load_choice(order, {"a": 2, "b": 2, "c": 2}, slack=0.5) == "b"
    # mean with the new call: (5 + 1 + 1 + 1) / 3 = 2.67, bound 4: b (5 + 1) is over it, c is the next
    assert bounded_load_choice(order, {"a": 1, "b": 5, "c": 1}, slack=0.5) == "c"
    assert bounded_load_choice(order, {"a": 0, "b": 5, "c": 4}, slack=0.0) == "a"
    assert bounded_load_choice(order, {"b": 9}, slack=0.0) == "c"  # an idle engine always takes a call


def test_bounded_load_holds_every_engine_within_the_bound_as_calls_arrive() -> None:
    """Keys assigned one at a time, none finishing: no engine passes (1 + slack) x the mean by more than a call,
    however unevenly the keys hash (the unbounded ring, for contrast, does)."""
    ring, slack = HashRing.of(engines(4)), 0.25
    keys = [f"hot-{index}" for index in range(400)]
    loads: Counter[str] = Counter()
    for key in keys:
        loads[bounded_load_choice(ring.walk(key), loads, slack)] += 1
    assert max(loads.values()) <= math.ceil((1 + slack) * len(keys) / 4)
    unbounded = Counter(ring.owner(key) for key in keys[:40])
    assert max(unbounded.values()) > (1 + slack) * 10  # the plain owners of these 40 keys are uneven


def test_a_big_call_that_fits_nowhere_goes_to_the_least_loaded_engine() -> None:
    assert bounded_load_choice(["a", "b"], {"a": 3, "b": 2}, slack=0.0, weight=8) == "b"


def test_least_load_prefers_the_local_engine_on_a_tie_then_takes_tied_engines_in_turn() -> None:
    loads = {"a": 1, "b": 0, "c": 0, "d": 0}
    assert least_loaded(list(loads), loads, local="c", turn=7) == "c"
    assert [least_loaded(list(loads), loads, local="a", turn=turn) for turn in range(3)] == ["b", "c", "d"]


def test_choose_engine_per_policy() -> None:
    ring = HashRing.of(engines(3))
    loads = {"rollout-0-0": 3.0, "rollout-0-1": 0.0, "rollout-0-2": 1.0}
    common = {"ring": ring, "loads": loads, "local": "rollout-0-0", "slack": 1.0}
    assert choose_engine("local", "k", turn=0, **common) == "rollout-0-0"
    assert [choose_engine("round-robin", None, turn=turn, **common) for turn in range(4)] == [
        "rollout-0-0", "rollout-0-1", "rollout-0-2", "rollout-0-0"]
    assert choose_engine("least-load", "k", turn=0, **common) == "rollout-0-1"
    # keyless: the local engine while within the bound (no hop), else the least loaded
    assert choose_engine("affinity", None, turn=0, **common) == "rollout-0-1"
    assert choose_engine("affinity", None, turn=0, **{**common, "loads": {**loads, "rollout-0-0": 1.0}}) == (
        "rollout-0-0")
    assert choose_engine("least-load", None, turn=0, **{**common, "loads": {**loads, "rollout-0-0": 1.0}}) == (
        "rollout-0-1")
    owner = ring.owner("session-9")
    assert choose_engine("affinity", "session-9", turn=0, **{**common, "loads": {}}) == owner
    second = ring.walk("session-9")[1]
    assert choose_engine("affinity", "session-9", turn=0, excluded=[owner], **{**common, "loads": {}}) == second


def test_choose_engine_names_what_it_cannot_do() -> None:
    ring = HashRing.of(engines(2))
    with pytest.raises(ValueError, match="unknown router policy 'sticky'"):
        choose_engine("sticky", "k", ring, {}, local="rollout-0-0", turn=0, slack=1.0)
    with pytest.raises(LookupError, match="no engine left"):
        choose_engine("affinity", "k", ring, {}, local="rollout-0-0", turn=0, slack=1.0, excluded=engines(2))
