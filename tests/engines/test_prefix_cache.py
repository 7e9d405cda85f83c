"""The prefix cache's tree on its own: what a match finds, what an insert writes, what eviction gives up, and that
keys and values of other weights are never offered.

Keys and values here are synthetic: element (row, column) of a row's cache holds the number of the token there, so
a gather shows exactly which tokens' keys and values came back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engines.inference.prefix_cache import Insert, PrefixCache, PrefixMatch

LAYERS, HEADS, HEAD_DIM = 2, 1, 2
BYTES_PER_TOKEN = 2 * LAYERS * HEADS * HEAD_DIM * 4  # float32 keys and values


def _rows(*sequences: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer [rows, heads, columns, head_dim] caches whose (row, column) entry is the token's value (keys) and
    its negative (values), layer l adding 1000 * l; rows left-padded with -1."""
    columns = max(len(sequence) for sequence in sequences)
    grid = torch.full((len(sequences), columns), -1.0)
    for row, sequence in enumerate(sequences):
        grid[row, columns - len(sequence):] = torch.tensor(sequence, dtype=torch.float32)
    keys = [(grid + 1000 * layer).view(len(sequences), 1, columns, 1).expand(-1, HEADS, -1, HEAD_DIM).clone()
            for layer in range(LAYERS)]
    return keys, [-layer_keys for layer_keys in keys]


def _insert(cache: PrefixCache, epoch: int, *sequences: list[int], version: int = 0,
            namespace: str | None = None) -> None:
    keys, values = _rows(*sequences)
    columns = keys[0].shape[2]
    entries = [Insert(list(sequence), row, torch.arange(columns - len(sequence), columns), version, epoch)
               for row, sequence in enumerate(sequences)]
    cache.insert(entries, keys, values, epoch, namespace=namespace)


def _gathered_tokens(cache: PrefixCache, match: PrefixMatch) -> list[int]:
    past = cache.gather([match.slots])
    keys, values = past.keys[1][0, 0, :, 0], past.values[1][0, 0, :, 0]
    assert torch.equal(values, -keys)
    return [int(value) - 1000 for value in keys.tolist()]


@pytest.mark.unit
def test_a_match_returns_the_longest_held_prefix_and_exactly_its_keys_and_values() -> None:
    cache = PrefixCache(1 << 20)
    _insert(cache, 0, [10, 11, 12, 13, 14])
    match = cache.match([10, 11, 12, 99, 100], epoch=0)
    assert match.length == 3 and _gathered_tokens(cache, match) == [10, 11, 12]
    assert cache.match([10, 11, 12, 13, 14], epoch=0, limit=4).length == 4  # the last token left to compute
    assert cache.match([11, 12], epoch=0).length == 0


@pytest.mark.unit
def test_branches_share_their_common_run_and_each_keeps_its_own_tokens() -> None:
    cache = PrefixCache(1 << 20)
    _insert(cache, 0, [1, 2, 3, 4, 5])
    _insert(cache, 0, [1, 2, 3, 7, 8, 9])  # cuts the first run after 3 tokens
    assert cache.held_tokens == 5 + 3
    for sequence in ([1, 2, 3, 4, 5], [1, 2, 3, 7, 8, 9]):
        match = cache.match(sequence, epoch=0)
        assert match.length == len(sequence) and _gathered_tokens(cache, match) == sequence
    _insert(cache, 0, [1, 2, 3])  # held already: nothing new
    assert cache.held_tokens == 8 and cache.counters.inserted_tokens == 8


@pytest.mark.unit
def test_padding_columns_gather_zeros_and_rows_are_right_aligned() -> None:
    cache = PrefixCache(1 << 20)
    _insert(cache, 0, [5, 6, 7, 8], [20, 21])
    long, short = cache.match([5, 6, 7, 8], epoch=0), cache.match([20, 21], epoch=0)
    past = cache.gather([long.slots, short.slots])
    assert past.lengths == [4, 2] and past.columns == 4
    assert past.keys[0][1, 0, :, 0].tolist() == [0.0, 0.0, 20.0, 21.0]


@pytest.mark.unit
def test_keys_and_values_of_other_weights_are_never_offered_and_count_as_stale() -> None:
    cache = PrefixCache(1 << 20)
    _insert(cache, 0, [1, 2, 3, 4, 5, 6], version=3)
    match = cache.match([1, 2, 3, 4, 5, 6, 7], epoch=1)
    assert (match.length, match.stale) == (0, 6)
    assert cache.holds([1, 2, 3, 4], epoch=1) == 0 and cache.holds([1, 2, 3, 4], epoch=0) == 4
    # computed again under the new weights: the run is rewritten in place and serves the new epoch only
    _insert(cache, 1, [1, 2, 3, 4], version=4)
    match = cache.match([1, 2, 3, 4, 5, 6], epoch=1)
    assert (match.length, match.stale, match.version) == (4, 2, 4) and cache.held_tokens == 6
    assert _gathered_tokens(cache, match) == [1, 2, 3, 4]


@pytest.mark.unit
def test_kept_across_updates_older_runs_are_offered_with_their_version() -> None:
    """recompute_kv_on_update=False (SGLang's keep): reuse, and say which version the keys and values are of."""
    cache = PrefixCache(1 << 20, same_weights_only=False)
    _insert(cache, 0, [1, 2, 3, 4], version=2)
    match = cache.match([1, 2, 3, 4, 9], epoch=5)
    assert (match.length, match.version, match.epoch) == (4, 2, 0)


@pytest.mark.unit
def test_a_full_pool_evicts_least_recently_used_leaves_and_never_exceeds_its_budget() -> None:
    cache = PrefixCache(16 * BYTES_PER_TOKEN)  # 16 tokens
    assert cache.capacity == 0  # allocated at the first insert, from the model's shapes
    _insert(cache, 0, [1, 2, 3, 4, 5, 6])
    _insert(cache, 0, [20, 21, 22, 23, 24, 25])
    assert cache.capacity == 16 and cache.held_tokens == 12
    cache.match([1, 2, 3], epoch=0)  # the first sequence is now the more recently used
    _insert(cache, 0, [40, 41, 42, 43, 44, 45])
    assert cache.held_tokens <= 16 and cache.counters.evicted_tokens == 6
    assert cache.holds([20, 21, 22, 23, 24, 25], epoch=0) == 0
    assert cache.holds([1, 2, 3, 4, 5, 6], epoch=0) == 6 and cache.holds([40, 41, 42, 43, 44, 45], epoch=0) == 6
    match = cache.match([40, 41, 42, 43, 44, 45], epoch=0)
    assert _gathered_tokens(cache, match) == [40, 41, 42, 43, 44, 45]  # the freed slots hold the new tokens


@pytest.mark.unit
def test_eviction_takes_runs_of_other_weights_before_any_usable_one() -> None:
    cache = PrefixCache(12 * BYTES_PER_TOKEN)
    _insert(cache, 0, [1, 2, 3, 4, 5, 6])
    _insert(cache, 1, [20, 21, 22, 23, 24, 25])  # the weights changed between the two
    cache.match([1, 2, 3, 4, 5, 6], epoch=0)  # recently used, but of old weights
    _insert(cache, 1, [40, 41, 42, 43])
    assert cache.holds([20, 21, 22, 23, 24, 25], epoch=1) == 6 and cache.holds([1, 2, 3], epoch=0) == 0


@pytest.mark.unit
def test_each_namespace_offers_only_its_own_runs_and_eviction_weighs_each_by_its_own_epoch() -> None:
    """Namespaces are the adapters: the same tokens hold other keys and values in each, and a namespace's epoch moves
    alone (a load of one adapter), so its old runs go first while another's equally old epoch is still current."""
    cache = PrefixCache(12 * BYTES_PER_TOKEN)
    _insert(cache, 0, [1, 2, 3, 4], namespace="a")
    assert cache.holds([1, 2, 3, 4], epoch=0, namespace="a") == 4
    assert cache.holds([1, 2, 3, 4], epoch=0) == cache.holds([1, 2, 3, 4], epoch=0, namespace="b") == 0
    _insert(cache, 0, [1, 2, 3, 4], namespace="b")
    _insert(cache, 1, [7, 8, 9, 10], namespace="a")  # a's weights changed: its first run is void, b's is not
    cache.match([1, 2, 3, 4], epoch=0, namespace="a", touch=True)  # recent, but no longer usable in a
    _insert(cache, 1, [30, 31, 32, 33])  # the base weights' run needs four slots
    assert cache.holds([1, 2, 3, 4], epoch=0, namespace="b") == 4  # older than a's void run, kept: still usable
    assert cache.holds([1, 2, 3, 4], epoch=0, namespace="a") == 0 and cache.counters.evicted_tokens == 4
    assert _gathered_tokens(cache, cache.match([7, 8, 9, 10], epoch=1, namespace="a")) == [7, 8, 9, 10]
    cache.forget("a")
    assert cache.held_tokens == 8 and cache.holds([7, 8, 9, 10], epoch=1, namespace="a") == 0


@pytest.mark.unit
def test_an_insert_larger_than_the_pool_keeps_what_fits_and_evicts_nothing_of_its_own() -> None:
    cache = PrefixCache(4 * BYTES_PER_TOKEN)
    _insert(cache, 0, [1, 2, 3, 4, 5, 6, 7])
    assert cache.held_tokens == 4 and cache.holds([1, 2, 3, 4, 5, 6, 7], epoch=0) == 4
    _insert(cache, 0, [9, 9, 9], [8, 8, 8])  # one insert of two sequences: the second cannot evict the first
    assert cache.holds([9, 9, 9], epoch=0) == 3 and cache.holds([8, 8, 8], epoch=0) == 1


@pytest.mark.unit
def test_a_match_cut_short_keeps_the_oldest_version_of_what_it_still_covers() -> None:
    cache = PrefixCache(1 << 20, same_weights_only=False)
    _insert(cache, 0, [1, 2, 3], version=1)
    _insert(cache, 0, [1, 2, 3, 4, 5, 6], version=0)
    match = cache.match([1, 2, 3, 4, 5, 6, 7], epoch=0)
    assert (match.length, match.version) == (6, 0)
    assert match.truncated(3).version == 1 and match.truncated(4).version == 0
    assert match.truncated(0).length == 0 and match.truncated(0).version is None
    assert np.array_equal(match.truncated(2).slots, match.slots[:2])


@pytest.mark.unit
def test_clearing_gives_the_pool_back_and_forgets_every_run() -> None:
    cache = PrefixCache(1 << 20)
    _insert(cache, 0, [1, 2, 3])
    cache.clear()
    assert cache.keys is None and cache.held_tokens == 0 and cache.holds([1, 2, 3], epoch=0) == 0
    _insert(cache, 0, [1, 2, 3])
    assert cache.holds([1, 2, 3], epoch=0) == 3


@pytest.mark.unit
def test_a_budget_below_one_byte_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="prefix cache budget"):
        PrefixCache(0)
