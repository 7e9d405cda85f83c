"""slime's ``--buffer-filter-path`` in the buffer: a plugin picks the next batch's groups from the pool, the oldest
fill any shortfall, an unusable answer is counted and the batch taken oldest-first, and the log replays the pick."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from actors.buffer.core import BufferCore
from actors.buffer.log import BufferLog
from actors.buffer.waits import gauges
from actors.config.flags import build_config
from actors.data.prompts import PromptRecord, PromptSource
from actors.slime_compat import Sample, pop_first
from actors.slime_compat.buffer_filter import load_buffer_filter
from bus.schema import Batch, BatchRequest, PromptGroup, ScoredGroup
from bus.schema import Sample as WireSample
from policies.plugins import PluginError
from tests.actors.test_buffer_core import _buffer_actor

pytestmark = pytest.mark.unit

N = 2  # samples per group
B = 3  # groups per batch
CALLS: list[tuple[int | None, int, int]] = []  # (rollout_id, num_samples, offered groups) per filter call


def mean_reward(group: list[Sample]) -> float:
    return sum(float(s.reward) for s in group) / len(group)


def highest_mean_first(args, rollout_id, buffer: list[list[Sample]], num_samples: int) -> list[list[Sample]]:
    """A slime-style filter: the best groups by mean reward, popped from ``buffer`` as slime's filters do."""
    CALLS.append((rollout_id, num_samples, len(buffer)))
    ranked = sorted(buffer, key=mean_reward, reverse=True)[:num_samples]
    for group in ranked:
        buffer.remove(group)
    return ranked


def newest_only(args, rollout_id, buffer, num_samples):
    return pop_first(args, rollout_id, buffer[::-1], 1)


def copies_of_the_newest(args, rollout_id, buffer, num_samples):
    return [copy.deepcopy(buffer[-1])]


def not_a_list(args, rollout_id, buffer, num_samples):
    return {"groups": buffer}


def not_groups(args, rollout_id, buffer, num_samples):
    return [sample for group in buffer[:num_samples] for sample in group]


def not_offered(args, rollout_id, buffer, num_samples):
    return [[Sample(reward=1.0), Sample(reward=1.0)]]


def same_group_twice(args, rollout_id, buffer, num_samples):
    return [buffer[-1], list(buffer[-1])]


def too_many(args, rollout_id, buffer, num_samples):
    return buffer[: num_samples + 1]


def raises(args, rollout_id, buffer, num_samples):
    raise RuntimeError("buffer filter exploded")


def wrong_signature(args, buffer):
    return buffer


def make_core(filter_name: str | None, *, log: BufferLog | None = None, errors: list[str] | None = None) -> BufferCore:
    config = build_config({"buffer_filter_path": f"{__name__}:{filter_name}" if filter_name else None,
                           "n_samples_per_prompt": N, "rollout_batch_size": B})
    data = [PromptRecord(i, f"{i}+1=", str(i + 1), {}) for i in range(50)]
    return BufferCore(source=PromptSource(data, seed=7), n_samples=N, groups_per_batch=B, max_staleness=2,
                      lease_timeout=10.0, log=log, batch_selector=load_buffer_filter(config),
                      on_selection_error=(errors if errors is not None else []).append)


def scored(group: PromptGroup, lease_id: str, rewards: tuple[float, ...]) -> ScoredGroup:
    samples = [WireSample(
        sample_id=f"{group.group_id}/{index}", group_id=group.group_id, index=index, prompt=group.prompt,
        prompt_tokens=2, tokens=np.array([5, 6, 7, 8], dtype=np.int32), response="x", response_length=2,
        label=group.label, reward=reward, loss_mask=np.ones(2, dtype=np.int8),
        rollout_log_probs=np.zeros(2, dtype=np.float32), token_versions=np.array([0, 0], dtype=np.int32),
        status="completed", metadata={"data_index": group.data_index},
    ) for index, reward in enumerate(rewards)]
    return ScoredGroup(lease_id=lease_id, group_id=group.group_id, samples=samples, worker_id="w")


# Six groups in admission order, mean rewards 0.0, 1.0, 0.25, 0.75, 0.5, 0.9.
REWARDS = [(0.0, 0.0), (1.0, 1.0), (0.0, 0.5), (0.5, 1.0), (0.0, 1.0), (0.8, 1.0)]


def fill_pool(core: BufferCore, rewards: list[tuple[float, ...]] = REWARDS) -> list[str]:
    leased = core.lease("w", len(rewards))
    assert leased is not None
    lease_id, groups = leased
    for group, reward in zip(groups, rewards, strict=True):
        assert core.accept(scored(group, lease_id, reward)) == "accepted"
    return [g.group_id for g in groups]


def batch_ids(core: BufferCore, batch_id: int = 1) -> list[str]:
    batch = core.next_batch(learner_version=batch_id - 1, trained_batch=batch_id - 1, checkpointed_batch=0)
    assert batch is not None
    return [g.group_id for g in batch.groups]  # a batch lists its groups in the order they were leased


def test_highest_mean_reward_filter_forms_the_batch_and_the_rest_wait() -> None:
    CALLS.clear()
    core = make_core("highest_mean_first")
    ids = fill_pool(core)
    assert batch_ids(core, 1) == [ids[1], ids[3], ids[5]]  # means 1.0, 0.75, 0.9: the three highest
    assert list(core.pool) == [ids[0], ids[2], ids[4]]  # still in admission order, for the next batch
    assert batch_ids(core, 2) == [ids[0], ids[2], ids[4]]
    assert CALLS == [(1, B, 6), (2, B, 3)]  # rollout_id is the batch being formed, num_samples the batch size
    assert not core.stats.selection_fallbacks


def test_a_short_answer_is_filled_with_the_oldest_groups() -> None:
    core = make_core("newest_only")
    ids = fill_pool(core)
    assert batch_ids(core) == [ids[0], ids[1], ids[5]]
    assert not core.stats.selection_fallbacks


def test_copied_samples_are_matched_by_the_group_id_in_their_metadata() -> None:
    core = make_core("copies_of_the_newest")
    ids = fill_pool(core)
    assert batch_ids(core) == [ids[0], ids[1], ids[5]]
    assert not core.stats.selection_fallbacks


@pytest.mark.parametrize(("filter_name", "reason"), [
    ("not_a_list", "not_a_list"), ("not_groups", "not_a_list"), ("not_offered", "not_offered"),
    ("same_group_twice", "duplicate"), ("too_many", "too_many"), ("raises", "raised"),
])
def test_an_unusable_answer_is_counted_reported_and_the_batch_taken_oldest_first(filter_name: str,
                                                                                 reason: str) -> None:
    errors: list[str] = []
    core = make_core(filter_name, errors=errors)
    ids = fill_pool(core)
    assert batch_ids(core) == ids[:B]
    assert core.stats.selection_fallbacks == {reason: 1}
    assert gauges(core)[f"buffer.selection_fallback.{reason}"] == 1.0
    assert len(errors) == 1 and f"--buffer-filter-path {__name__}:{filter_name}" in errors[0]
    assert "batch 1 taken oldest-first" in errors[0]


def test_restore_after_a_filtered_batch_serves_the_same_batch(tmp_path: Path) -> None:
    log_path = tmp_path / "log.msgpack"
    core = make_core("highest_mean_first", log=BufferLog(log_path))
    ids = fill_pool(core)
    first = batch_ids(core)
    assert first == [ids[1], ids[3], ids[5]]
    core.log.close()

    revived = make_core(None)  # the log, not the plugin, decides what batch 1 was
    revived.restore(log_path)
    assert list(revived.pool) == [ids[0], ids[2], ids[4]]
    again = revived.next_batch(learner_version=0, trained_batch=0, checkpointed_batch=0)
    assert again is not None and again.replayed and [g.group_id for g in again.groups] == first


def test_example_plugin_trains_the_widest_reward_spread_first() -> None:
    config = build_config({"buffer_filter_path": "examples.slime_style.buffer_filter:highest_variance_first",
                           "n_samples_per_prompt": N, "rollout_batch_size": B})
    data = [PromptRecord(i, f"{i}+1=", str(i + 1), {}) for i in range(50)]
    core = BufferCore(source=PromptSource(data, seed=7), n_samples=N, groups_per_batch=B, max_staleness=2,
                      lease_timeout=10.0, batch_selector=load_buffer_filter(config))
    ids = fill_pool(core)  # reward variances 0, 0, 0.0625, 0.0625, 0.25, 0.01
    assert batch_ids(core) == [ids[2], ids[3], ids[4]]


def test_pop_first_takes_the_oldest_groups_out_of_the_buffer() -> None:
    buffer: list[list[Any]] = [["a"], ["b"], ["c"]]
    assert pop_first(None, None, buffer, 2) == [["a"], ["b"]] and buffer == [["c"]]
    assert pop_first(None, None, buffer, 5) == [["c"]] and buffer == []


def test_a_filter_without_slimes_signature_is_refused_at_start_up() -> None:
    with pytest.raises(TypeError, match=r"--buffer-filter-path .*wrong_signature.*rollout_id, buffer, num_samples"):
        load_buffer_filter(build_config({"buffer_filter_path": f"{__name__}:wrong_signature"}))
    with pytest.raises(PluginError, match="--buffer-filter-path"):
        load_buffer_filter(build_config({"buffer_filter_path": f"{__name__}:no_such_filter"}))
    assert load_buffer_filter(build_config({"buffer_filter_path": "slime.rollout.data_source.pop_first"})) is None


PROCESSED: list[dict[str, Any]] = []


def record_all_groups(args, all_groups, data_source):
    """slime's --rollout-all-samples-process-path: sees every group generated for the batch."""
    PROCESSED.append({"rewards": [tuple(float(s.reward) for s in group) for group in all_groups],
                      "data_indexes": [group[0].group_index for group in all_groups], "data_source": data_source})


@pytest.mark.integration
def test_the_all_samples_hook_sees_each_batch_with_the_groups_the_dynamic_filter_dropped(tmp_path: Path) -> None:
    """Called once when batch 1 first forms (not when it is served again): its 3 groups and the 2 groups the dynamic
    filter dropped before it, sorted by prompt as slime sorts them; slime's data_source is a stand-in that says why
    it cannot be used."""
    PROCESSED.clear()
    rewards = [(1.0, 0.0), (1.0, 1.0), (0.0, 1.0), (0.0, 0.0), (0.5, 1.0)]  # the 2nd and 4th have no spread

    async def scenario() -> list[Batch]:
        buffer = _buffer_actor(tmp_path, dynamic_sampling_filter_path="nonzero_std",
                               rollout_all_samples_process_path=f"{__name__}:record_all_groups")
        await buffer.on_start()
        leased = buffer.core.lease("w", len(rewards))
        assert leased is not None
        lease_id, groups = leased
        for group, reward in zip(groups, rewards, strict=True):
            await buffer.on_scored("reward-0", scored(group, lease_id, reward))
        request = BatchRequest(learner_version=0, trained_batch=0, checkpointed_batch=0)
        served = [await buffer.on_batch_request("learner-0", request) for _ in range(2)]  # the second: a re-ask
        await buffer.on_stop()
        buffer.zmq.destroy(linger=0)
        return served

    first, again = asyncio.run(scenario())
    assert isinstance(first, Batch) and len(first.samples) == B * N and again.replayed
    [call] = PROCESSED
    assert sorted(call["rewards"]) == sorted(rewards)  # the 3 trained groups and the 2 dropped ones
    assert call["data_indexes"] == sorted(call["data_indexes"])
    with pytest.raises(RuntimeError, match="the buffer owns the prompt cursor"):
        call["data_source"](1)
    with pytest.raises(RuntimeError, match="the buffer owns the prompt cursor"):
        call["data_source"].get_samples(1)
