"""slime's --data-source-path and --disable-rollout-global-dataset: a user's DataSource (tests/support) feeds the
buffer's new prompt groups; the buffer names them, trains each exactly once, and a resumed buffer continues the
source where it was (its save at a checkpoint, its load on resume)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from actors.buffer.actor import Buffer
from actors.buffer.core import BufferCore
from actors.buffer.log import BufferLog
from actors.config import build_config
from actors.config.preflight import _data_problems
from actors.data.prompts import EmptyPrompts, PromptStreamError
from actors.extensions.load import prompt_stream
from actors.runtime.context import ActorContext
from bus.schema import Batch, BatchRequest, Lease, LeaseRequest
from policies.plugins import PluginError
from tests.actors.test_buffer_core import scored
from tests.support import slime_data_source

N, B = 2, 3  # samples per group, groups per batch
SOURCE = "tests.support.slime_data_source"


def config(source: str = "CountingSource", **settings: object):
    return build_config({"data_source_path": f"{SOURCE}:{source}", "n_samples_per_prompt": N,
                         "rollout_batch_size": B, "max_staleness": 1, **settings})


def buffer_core(run: Path, source: str = "CountingSource") -> BufferCore:
    """A buffer over the run folder `run` as the actor builds it: restored from its log when there is one."""
    core = BufferCore(source=prompt_stream(config(source), run / "data_source"), n_samples=N, groups_per_batch=B,
                      max_staleness=1, lease_timeout=10.0)
    if (run / "log.msgpack").exists():
        core.restore(run / "log.msgpack")
    core.log = BufferLog(run / "log.msgpack")
    return core


def train(core: BufferCore, batches: range, *, checkpointed: int) -> list[str]:
    """Lease, score and serve `batches`, the learner's checkpoint at `checkpointed`; the prompts trained."""
    trained = []
    for batch_id in batches:
        while (batch := core.next_batch(learner_version=batch_id - 1, trained_batch=batch_id - 1,
                                        checkpointed_batch=checkpointed)) is None:
            lease_id, groups = core.lease("w", B)
            for group in groups:
                assert core.accept(scored(group, lease_id, version=batch_id - 1)) == "accepted"
        assert batch.batch_id == batch_id
        trained += [g.samples[0].prompt for g in batch.groups]
    return trained


@pytest.mark.unit
def test_a_users_source_feeds_the_buffer_each_group_named_and_trained_once(tmp_path: Path) -> None:
    slime_data_source.CALLS.clear()
    core = buffer_core(tmp_path)
    trained = train(core, range(1, 4), checkpointed=0)
    assert trained == [f"q{i}" for i in range(9)]  # the source's order, no prompt twice
    group = core.served[1].groups[0]
    assert group.group_id == "0:0" and group.samples[0].label == "0"
    assert ("init", str(tmp_path / "data_source")) in slime_data_source.CALLS  # args.save: the buffer's folder
    assert not [call for call in slime_data_source.CALLS if call[0] == "add_samples"]  # re-issues stay ours


@pytest.mark.unit
def test_a_resumed_buffer_loads_the_source_at_its_checkpoint_and_continues_where_it_was(tmp_path: Path) -> None:
    slime_data_source.CALLS.clear()
    core = buffer_core(tmp_path)
    trained = train(core, range(1, 3), checkpointed=0)
    # The learner checkpointed batch 1 (the source saves at slime's rollout id 0), then batch 3 is leased, part of
    # it scored, and the buffer dies with a lease out.
    assert train(core, range(3, 4), checkpointed=1) == ["q6", "q7", "q8"]
    assert ("save", 0) in slime_data_source.CALLS
    lease_id, out = core.lease("w", 2)
    core.accept(scored(out[0], lease_id))
    core.log.close()
    slime_data_source.CALLS.clear()

    resumed = buffer_core(tmp_path)
    assert slime_data_source.CALLS[:2] == [("init", str(tmp_path / "data_source")), ("load", 0)]
    assert [g.prompt for g in resumed.reissue] == []  # the dead lease is re-issued when it expires or the worker
    resumed.worker_gone("w")  # is announced gone; here at once
    trained_after = train(resumed, range(2, 5), checkpointed=1)
    # batch 2 and 3 served again identically (not committed), then the group in flight, then new prompts from q11
    assert trained_after[:6] == [*trained[3:6], "q6", "q7", "q8"]
    assert sorted(trained_after[6:]) == ["q10", "q11", "q9"]
    every = trained[:3] + trained_after
    assert sorted(every, key=lambda p: int(p[1:])) == [f"q{i}" for i in range(12)]  # none lost, none twice


@pytest.mark.unit
@pytest.mark.parametrize(("source", "problem"), [
    ("ShortGroups", r"get_samples\(1\) group 0: expected a list of n_samples_per_prompt = 2 samples, got 1 samples"),
    ("MixedPrompts", r"get_samples\(1\) group 0: its samples have different prompts"),
    ("Raises", r"get_samples\(1\) raised KeyError: 'shard-7'"),
])
def test_a_malformed_answer_of_the_source_is_named(tmp_path: Path, source: str, problem: str) -> None:
    core = buffer_core(tmp_path, source)
    with pytest.raises(PromptStreamError, match=rf"--data-source-path {SOURCE}:{source}: {problem}"):
        core.lease("w", 1)


@pytest.mark.unit
def test_a_source_that_runs_dry_leases_what_it_gave_and_is_asked_again(tmp_path: Path) -> None:
    core = buffer_core(tmp_path, "RunsDry")
    _, groups = core.lease("w", 3)
    assert [g.prompt for g in groups] == ["q0", "q1"]
    assert core.lease("w", 3) is None and core.stats.started == 2


@pytest.mark.unit
def test_a_class_without_slimes_methods_or_that_fails_to_build_is_refused_at_start(tmp_path: Path) -> None:
    with pytest.raises(PluginError, match=r"NoSave has no save, load \(slime's DataSource interface"):
        prompt_stream(config("NoSave"), tmp_path)
    with pytest.raises(PluginError, match="has no attribute 'Missing'"):
        prompt_stream(config("Missing"), tmp_path)


@pytest.mark.unit
def test_no_global_dataset_gives_empty_prompts_and_needs_a_function_of_yours(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"rollout_global_dataset off .* only a function of yours can replace"):
        build_config({"rollout_global_dataset": False})
    run = build_config({"rollout_global_dataset": False, "custom_generate_function_path": "my.module:generate"})
    stream = prompt_stream(run, tmp_path)
    assert isinstance(stream, EmptyPrompts)
    core = BufferCore(source=stream, n_samples=N, groups_per_batch=B, max_staleness=0, lease_timeout=10.0)
    _, groups = core.lease("w", 5)
    assert [(g.group_id, g.prompt, g.label) for g in groups] == [("0:0", "", None), ("0:1", "", None),
                                                                 ("0:2", "", None)]
    assert _data_problems(run, {"buffer"}) == []  # no --prompt-data to ask for
    assert _data_problems(config(), {"buffer"}) == []
    with pytest.raises(ValueError, match=r"num_epoch with data_source_path: .* give num_rollout"):
        config(num_epoch=2)


def _buffer_actor(run_dir: Path, source: str) -> Buffer:
    run = config(source, lease_timeout=30.0)
    return Buffer(ActorContext(actor_id="buffer-0", role="buffer", actor_class="actors.buffer.actor:Buffer",
                               node_rank=0, head_address="tcp://127.0.0.1:1", run_dir=run_dir,
                               settings={"run": run}))


@pytest.mark.integration
def test_the_buffer_actor_serves_the_sources_groups_and_fails_the_run_on_a_bad_one(tmp_path: Path) -> None:
    async def scenario() -> None:
        buffer = _buffer_actor(tmp_path / "good", "CountingSource")
        await buffer.on_start()
        lease = await buffer.on_lease_request("rollout-0", LeaseRequest(worker_id="rollout-0", max_groups=B))
        assert isinstance(lease, Lease) and [g.prompt for g in lease.groups] == ["q0", "q1", "q2"]
        for group in lease.groups:
            await buffer.on_scored("reward-0", scored(group, lease.lease_id))
        batch = await buffer.on_batch_request("learner", BatchRequest(learner_version=0, trained_batch=0,
                                                                      checkpointed_batch=0))
        assert isinstance(batch, Batch) and [s.prompt for s in batch.samples] == ["q0", "q0", "q1", "q1", "q2", "q2"]
        await buffer.on_stop()

        broken = _buffer_actor(tmp_path / "bad", "ShortGroups")
        await broken.on_start()
        empty = await broken.on_lease_request("rollout-0", LeaseRequest(worker_id="rollout-0", max_groups=1))
        assert empty.groups == [] and broken.stopping
        assert broken.run_failure.startswith(f"--data-source-path {SOURCE}:ShortGroups: get_samples(1) group 0")
        await broken.on_stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))
