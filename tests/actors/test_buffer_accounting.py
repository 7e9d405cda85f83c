"""The buffer's account of its prompts, read back from a log a real BufferCore wrote: every group's fate, the
evictions with their staleness, compactions crossed, length buckets and bias, and a prompt skipped by a resume
whose data cursor jumped failing the check."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from actors.buffer.accounting import prompt_verdict
from actors.buffer.core import BufferCore
from actors.buffer.log import BufferLog
from actors.data.prompts import Cursor
from bus.schema import PromptGroup, Sample, ScoredGroup
from tests.actors.test_buffer_core import B, N, lease_all, make_core

pytestmark = pytest.mark.unit


def answered(group: PromptGroup, lease_id: str, *, length: int, version: int = 0,
             status: str = "completed") -> ScoredGroup:
    """A scored group whose samples are `length` tokens long, generated at `version`."""
    samples = [Sample(sample_id=f"{group.group_id}/{i}", group_id=group.group_id, index=i, prompt=group.prompt,
                      prompt_tokens=2, tokens=np.arange(2 + length, dtype=np.int32), response="x" * length,
                      response_length=length, label=group.label, reward=1.0 if status == "completed" else None,
                      loss_mask=np.ones(length, dtype=np.int8), rollout_log_probs=np.zeros(length, np.float32),
                      token_versions=np.full(length, version, dtype=np.int32), status=status)
               for i in range(N)]
    return ScoredGroup(lease_id=lease_id, group_id=group.group_id, samples=samples, worker_id="w")


def _trained(run_dir: Path, *batch_ids: int) -> None:
    (run_dir / "metrics").mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics" / "trained_samples.jsonl", "a") as file:
        for batch_id in batch_ids:
            file.write(json.dumps({"batch_id": batch_id, "version": batch_id, "sample_ids": []}) + "\n")


def _core(run_dir: Path) -> BufferCore:
    (run_dir / "buffer").mkdir(parents=True, exist_ok=True)
    return make_core(max_staleness=2, log=BufferLog(run_dir / "buffer" / "log.msgpack"))


def test_every_group_has_a_fate_and_long_answers_evicted_as_stale_show_as_a_length_bias(tmp_path: Path) -> None:
    core = _core(tmp_path)
    lease_id, groups = lease_all(core)  # (0 + 2 + 1) x B = 9 groups
    for group in groups[:B]:
        core.accept(answered(group, lease_id, length=2))
    assert core.next_batch(learner_version=0, trained_batch=0, checkpointed_batch=0) is not None
    _trained(tmp_path, 1)
    core.log.compact(core.snapshot())  # the history goes on in a new segment; the account reads both
    for group in groups[B:2 * B]:
        core.accept(answered(group, lease_id, length=8, version=0))
    # Trained at version 3, these long answers of version 0 are 3 steps old: evicted, to be generated again.
    assert core.next_batch(learner_version=3, trained_batch=1, checkpointed_batch=0) is None
    core.accept(answered(groups[2 * B], lease_id, length=2, status="failed"))
    core.log.close()

    verdict = prompt_verdict(tmp_path)
    assert verdict["verdict"] == "pass" and verdict["skipped"] == 0 and verdict["prompt_groups"] == 3 * B
    assert verdict["fates"] == {"trained": B, "in flight": B + 2, "dropped: failed_samples": 1}
    assert verdict["regenerated"] == {"evictions": B, "leased_again": 0}
    assert verdict["eviction_staleness"] == {"3": B}
    assert verdict["by_length"]["evicted_vs_trained_length"] == 4.0  # 8-token answers evicted, 2-token trained
    assert sum(bucket["evictions"] for bucket in verdict["by_length"]["buckets"]) == B


def test_a_resume_whose_data_cursor_jumped_fails_with_the_prompts_it_passed_over(tmp_path: Path) -> None:
    core = _core(tmp_path)
    lease_all(core, max_groups=4)
    core.log.close()

    resumed = _core(tmp_path)
    resumed.restore(tmp_path / "buffer" / "log.msgpack")
    cursor = resumed.source.cursor
    resumed.source.cursor = Cursor(cursor.epoch, cursor.position + 2)  # the bug: two prompts never leased
    lease_all(resumed, max_groups=3)
    resumed.log.close()

    verdict = prompt_verdict(tmp_path)
    assert verdict["verdict"] == "fail" and verdict["skipped"] == 2


def test_a_group_leased_again_after_its_lease_expired_counts_as_regenerated(tmp_path: Path) -> None:
    core = _core(tmp_path)
    _, groups = lease_all(core, max_groups=1)
    core.clock.now += 60.0  # past the lease: the group is given to the next request
    core.expire_leases()
    again, regiven = lease_all(core, max_groups=1)
    assert [g.group_id for g in regiven] == [groups[0].group_id]
    core.accept(answered(regiven[0], again, length=3))
    core.log.close()
    verdict = prompt_verdict(tmp_path)
    assert verdict["regenerated"] == {"evictions": 0, "leased_again": 1}
    assert verdict["fates"] == {"waiting in the pool": 1}


def test_a_run_without_a_buffer_log_says_the_check_did_not_run(tmp_path: Path) -> None:
    log = tmp_path / "buffer" / "log.msgpack"
    assert prompt_verdict(tmp_path) == {"verdict": "not run", "why": f"no buffer log at {log}"}


def test_a_log_whose_archives_were_deleted_counts_from_its_snapshot_and_says_so(tmp_path: Path) -> None:
    core = _core(tmp_path)
    lease_all(core, max_groups=4)
    core.log.compact(core.snapshot())
    (tmp_path / "buffer" / "log.msgpack.1").unlink()  # a user cleaned the archives up
    lease_all(core, max_groups=2)
    core.log.close()
    verdict = prompt_verdict(tmp_path)
    assert verdict["verdict"] == "pass" and verdict["skipped"] == 0  # the 4 before the snapshot are not gaps
    assert verdict["prompt_groups"] == 2 and "archives are gone" in verdict["note"]
