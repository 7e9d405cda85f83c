"""tools/audit_run.py's "versions monotone" checks, on run directories written the way the buffer and learner
write them (a real BufferLog of encoded groups, the learner's trained_samples.jsonl, config.yaml)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from actors.buffer.log import BufferLog
from bus.codec import encode
from bus.schema import Sample, ScoredGroup
from tools.audit_run import audit, describe_report

pytestmark = pytest.mark.unit


def group(group_id: str, token_versions: list[int]) -> ScoredGroup:
    """One group of one sample whose response tokens carry `token_versions`."""
    n = len(token_versions)
    sample = Sample(sample_id=f"{group_id}/0", group_id=group_id, index=0, prompt="p", prompt_tokens=1,
                    tokens=np.arange(n + 1, dtype=np.int32), response_length=n, reward=1.0, status="completed",
                    token_versions=np.asarray(token_versions, dtype=np.int32))
    return ScoredGroup(lease_id="l", group_id=group_id, samples=[sample], worker_id="rollout-0-0")


def write_run(run_dir: Path, served: list[tuple[list[int], int]], lineage: list[tuple[int, int]],
              max_staleness: int = 1, remeasured: dict[int, int] | None = None) -> Path:
    """`served`: per batch (its one sample's token versions, the version the buffer served it at), batch ids from 1;
    `lineage`: the learner's records in order, (batch id, version the step left); `remeasured`: batch id -> the
    version the buffer measured it again at (served ahead of a step that applied no update)."""
    (run_dir / "metrics").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(f"buffer:\n  max_staleness: {max_staleness}\n")
    log = BufferLog(run_dir / "buffer" / "log.msgpack")
    for batch_id, (versions, served_at) in enumerate(served, start=1):
        scored = group(f"g{batch_id}", versions)
        log.append("accept", group_id=scored.group_id, group=encode(scored))
        log.append("batch", batch_id=batch_id, group_ids=[scored.group_id], staleness=[0], learner_version=served_at)
    for batch_id, version in (remeasured or {}).items():
        log.append("remeasure", batch_id=batch_id, staleness=[0], learner_version=version)
    log.close()
    lines = [json.dumps({"batch_id": b, "version": v, "sample_ids": [f"g{b}/0"]}) for b, v in lineage]
    (run_dir / "metrics" / "trained_samples.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


def test_a_consistent_run_passes(tmp_path: Path) -> None:
    run = write_run(tmp_path, served=[([0, 0], 0), ([0, 1], 1), ([1, 2], 2)], lineage=[(1, 1), (2, 2), (3, 3)])
    report = audit(run)
    assert report.ok, report.problems
    assert report.final_version == 3 and report.newer_token_samples == 0


def test_a_version_that_goes_backwards_is_a_problem(tmp_path: Path) -> None:
    run = write_run(tmp_path, served=[([0], 0), ([0], 1), ([0], 2)], lineage=[(1, 1), (2, 2), (3, 1)])
    assert any("version went backwards: batch 2 left 2, batch 3 left 1" in p for p in audit(run).problems)


def test_a_batch_served_at_another_version_than_it_trained_at_is_a_problem(tmp_path: Path) -> None:
    """The buffer measured (and bounded) its staleness against a version the batch was not trained at."""
    run = write_run(tmp_path, served=[([0], 0), ([0], 0)], lineage=[(1, 1), (2, 2)])
    assert audit(run).problems == ["batch 2: served (and its staleness measured) at version 0, trained at 1"]


def test_a_batch_served_ahead_of_a_skipped_step_counts_at_the_version_it_was_measured_again_at(tmp_path: Path) -> None:
    """Step 1 applied no update (it left version 0); batch 2 was served ahead at version 1, then measured at 0."""
    served, lineage = [([0], 0), ([0], 1)], [(1, 0), (2, 1)]
    assert audit(write_run(tmp_path / "remeasured", served, lineage, remeasured={2: 0})).ok
    problems = audit(write_run(tmp_path / "not", served, lineage)).problems
    assert problems == ["batch 2: served (and its staleness measured) at version 1, trained at 0"]


def test_a_token_past_the_staleness_bound_is_a_problem(tmp_path: Path) -> None:
    run = write_run(tmp_path, served=[([0], 0), ([0], 1), ([0, 2], 2)], lineage=[(1, 1), (2, 2), (3, 3)])
    [problem] = audit(run).problems
    assert "batch 3 (trained at version 2): staleness 2 over the bound 1" in problem


def test_tokens_newer_than_the_learner_need_an_abandoned_step(tmp_path: Path) -> None:
    """Newer tokens than the version trained at come only from weights of steps a restarted learner gave up."""
    steady = write_run(tmp_path / "steady", served=[([0], 0), ([2], 1)], lineage=[(1, 1), (2, 2)])
    assert any("hold tokens newer than version 1" in p for p in audit(steady).problems)

    # The learner trained batches 1 and 2 (pushing version 2's weights), restarted from its checkpoint after batch
    # 1 and trained batch 2 again: a token of version 2 in batch 2 is from the abandoned lineage, within the bound.
    restarted = write_run(tmp_path / "restarted", served=[([0], 0), ([2], 1)], lineage=[(1, 1), (2, 2), (2, 2)])
    report = audit(restarted)
    assert report.ok, report.problems
    assert report.retrained_batches == 1 and report.newer_token_samples == 1


def test_a_batch_trained_again_after_a_restart_is_not_reported_as_a_double_train(tmp_path: Path) -> None:
    """The learner died after training batch 2 and before checkpointing it: its restart trained batch 2 again from
    the step-1 checkpoint. The audit's words must say that, not "retrained", which reads as trained twice."""
    restarted = write_run(tmp_path, served=[([0], 0), ([1], 1)], lineage=[(1, 1), (2, 2), (2, 2)])
    report = audit(restarted)
    assert report.ok, report.problems
    lines = describe_report(report)
    assert lines[1] == ("redone after a learner restart: 1 batch that the learner had trained but not yet "
                        "checkpointed when it died, trained again from its checkpoint; the final weights hold each "
                        "batch once")
    assert not any("retrained" in line for line in lines)
    steady = audit(write_run(tmp_path / "steady", served=[([0], 0), ([1], 1)], lineage=[(1, 1), (2, 2)]))
    assert len(describe_report(steady)) == 1  # no restart, nothing redone: one line of counts
