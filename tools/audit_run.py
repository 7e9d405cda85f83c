"""Audit a run directory: was every accepted sample trained exactly once, did versions only move forward, and what
does its integrity certificate say (`actors/report/integrity.py`)? `python -m tools.audit_run RUN_DIR`.

Sources: the buffer's durable log with its archived segments (what was accepted, evicted, put in which batch, at
which version, measured again at which version when it was served ahead of a step that applied no update,
committed), the learner's `metrics/trained_samples.jsonl` (what it trained, batch by batch, and the version each
step left; a learner that resumed from a checkpoint trains the batches after it again, and the last record of a
batch id is the one in the final model's lineage) and `config.yaml` (the staleness bound).

Exactly once. The lineage trains batches 1..N once each, every trained batch holds exactly the groups the buffer
put in it, no sample appears in two batches, and every accepted group is either trained or still waiting in the
buffer (nothing accepted was lost).

Versions monotone. Write V(k) for the version batch k's step left (its lineage record) and T(k) for the version
batch k was trained at: V(k-1) for k > 1, and for batch 1 the version the buffer served it at.
- V(k) never decreases with k, and neither does the version the buffer served batch k at;
- the buffer served batch k at T(k), so the staleness it measured (and bounded) is the staleness trained;
- every token of every trained sample is within the bound: |T(k) - t| <= --max-staleness for each token version t;
- no token is newer than the weights it was trained against (t <= T(k)), unless the learner restarted from a
  checkpoint and abandoned trained steps (a batch trained twice): the engines may then still serve that abandoned
  lineage's weights for a while, which policies.staleness deliberately measures as |T(k) - t| (counted here as
  `newer_token_samples`, not a problem).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from actors.buffer.accounting import prompt_verdict
from actors.buffer.log import BufferLog, archived_logs
from actors.report.integrity import certify, describe, recorded_run_failure
from bus.codec import decode


@dataclass
class AuditReport:
    accepted_groups: int = 0
    trained_batches: int = 0
    trained_samples: int = 0
    trained_groups: int = 0
    pending_groups: int = 0
    retrained_batches: int = 0  # batches trained again after a learner restart (expected, not an error)
    final_version: int = 0  # the version the lineage's last step left
    newer_token_samples: int = 0  # trained samples with a token newer than the learner (abandoned-lineage weights)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class BatchRecord:
    """What the buffer's log says about one batch: its groups, the version it was served at, and per sample the
    (oldest, newest) token version (None where the accepted payload is not in the log any more)."""

    group_ids: list[str]
    learner_version: int | None
    token_ranges: dict[str, tuple[int, int]] | None


def audit(run_dir: Path) -> AuditReport:
    report = AuditReport()
    accepted, ever_accepted, batches = _read_buffer_log(run_dir)
    report.accepted_groups = len(accepted | {g for batch in batches.values() for g in batch.group_ids})

    lineage: dict[int, dict[str, Any]] = {}
    path = run_dir / "metrics" / "trained_samples.jsonl"
    for line in path.read_text(encoding="utf-8").splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line torn by kill -9 of the learner
        if record["batch_id"] in lineage:
            report.retrained_batches += 1
        lineage[record["batch_id"]] = record

    report.trained_batches = len(lineage)
    if sorted(lineage) != list(range(1, len(lineage) + 1)):
        report.problems.append(f"trained batch ids are not 1..{len(lineage)}: {sorted(lineage)}")
    owner: dict[str, int] = {}
    for batch_id, record in sorted(lineage.items()):
        for sample_id in record["sample_ids"]:
            if sample_id in owner:
                report.problems.append(f"sample {sample_id} trained in batches {owner[sample_id]} and {batch_id}")
            owner[sample_id] = batch_id
        trained_groups = sorted({sample_id.rsplit("/", 1)[0] for sample_id in record["sample_ids"]})
        if batch_id not in batches:
            report.problems.append(f"batch {batch_id} was trained but the buffer log never assembled it")
        elif trained_groups != sorted(batches[batch_id].group_ids):
            report.problems.append(f"batch {batch_id}: trained groups {trained_groups} != assembled "
                                   f"{sorted(batches[batch_id].group_ids)}")
    report.trained_samples = len(owner)
    report.trained_groups = len({sample_id.rsplit("/", 1)[0] for sample_id in owner})
    in_batches = {g for batch in batches.values() for g in batch.group_ids}
    never_accepted = in_batches - ever_accepted
    if never_accepted:
        report.problems.append(f"groups batched without being accepted: {sorted(never_accepted)[:10]}")
    # Accepted groups not yet in a batch, and batches assembled but not trained when the run ended, are still
    # in the buffer's log: pending, not lost. Everything else was checked batch by batch above.
    untrained = [g for b, batch in batches.items() if b not in lineage for g in batch.group_ids]
    report.pending_groups = len(accepted - in_batches) + len(untrained)
    _audit_versions(report, lineage, batches, max_staleness(run_dir))
    return report


def _read_buffer_log(run_dir: Path) -> tuple[set[str], set[str], dict[int, BatchRecord]]:
    """(accepted and not evicted, ever accepted, batches) from the log and its archives, in order."""
    accepted: set[str] = set()
    ever_accepted: set[str] = set()
    payloads: dict[str, bytes] = {}  # group id -> its latest accepted ScoredGroup, encoded
    batches: dict[int, BatchRecord] = {}
    log_path = run_dir / "buffer" / "log.msgpack"
    history = (record for path in [*archived_logs(log_path), log_path] for record in BufferLog.replay(path))
    for record in history:
        kind = record["kind"]
        if kind == "accept":
            accepted.add(record["group_id"])
            ever_accepted.add(record["group_id"])
            payloads[record["group_id"]] = record["group"]
        elif kind in ("evict", "drop"):  # regenerated (only a later acceptance counts), or an adopted group dropped
            accepted.discard(record["group_id"])
        elif kind == "snapshot" and not payloads:  # the archives before this compaction were deleted
            for raw in [*record.get("pool", []), *(g for b in record.get("served", []) for g in b["groups"])]:
                payloads.setdefault(decode(raw).group_id, raw)
        elif kind == "batch":
            group_ids = list(record["group_ids"])
            batches[record["batch_id"]] = BatchRecord(group_ids, record.get("learner_version"),
                                                      _token_ranges([payloads.get(g) for g in group_ids]))
        elif kind == "remeasure" and record["batch_id"] in batches:  # served ahead of a step that kept its version
            batches[record["batch_id"]].learner_version = record["learner_version"]
    return accepted, ever_accepted, batches


def _token_ranges(payloads: list[bytes | None]) -> dict[str, tuple[int, int]] | None:
    if any(raw is None for raw in payloads):
        return None
    ranges = {}
    for raw in payloads:
        for sample in decode(raw).samples:
            versions = sample.token_versions
            if versions is not None and len(versions):
                ranges[sample.sample_id] = (int(versions.min()), int(versions.max()))
    return ranges


def _audit_versions(report: AuditReport, lineage: dict[int, dict[str, Any]], batches: dict[int, BatchRecord],
                    bound: int | None) -> None:
    """The "versions monotone" checks of the module docstring, on the final lineage."""
    previous_left: int | None = None
    previous_served: int | None = None
    abandoned_steps = report.retrained_batches > 0
    for batch_id in sorted(lineage):
        left = lineage[batch_id].get("version")
        batch = batches.get(batch_id)
        served = batch.learner_version if batch is not None else None
        if left is None:
            continue
        if previous_left is not None and left < previous_left:
            report.problems.append(f"version went backwards: batch {batch_id - 1} left {previous_left}, "
                                   f"batch {batch_id} left {left}")
        if served is not None and previous_served is not None and served < previous_served:
            report.problems.append(f"buffer served batch {batch_id} at version {served} after serving batch "
                                   f"{batch_id - 1} at {previous_served}")
        trained_at = previous_left if batch_id > 1 else served
        if served is not None and trained_at is not None and served != trained_at:
            report.problems.append(f"batch {batch_id}: served (and its staleness measured) at version {served}, "
                                   f"trained at {trained_at}")
        if batch is not None and batch.token_ranges is not None and trained_at is not None:
            _audit_tokens(report, batch_id, batch.token_ranges, trained_at, bound, abandoned_steps)
        previous_left = left
        previous_served = served if served is not None else previous_served
    report.final_version = previous_left or 0


def _audit_tokens(report: AuditReport, batch_id: int, ranges: dict[str, tuple[int, int]], trained_at: int,
                  bound: int | None, abandoned_steps: bool) -> None:
    over = {sample: max(trained_at - oldest, newest - trained_at) for sample, (oldest, newest) in ranges.items()}
    if bound is not None and (worst := max(over.values(), default=0)) > bound:
        stale = sorted(sample for sample, staleness in over.items() if staleness > bound)
        report.problems.append(f"batch {batch_id} (trained at version {trained_at}): staleness {worst} over the bound "
                               f"{bound} in samples {stale[:5]}")
    newer = sorted(sample for sample, (_, newest) in ranges.items() if newest > trained_at)
    report.newer_token_samples += len(newer)
    if newer and not abandoned_steps:
        report.problems.append(f"batch {batch_id}: samples {newer[:5]} hold tokens newer than version {trained_at} "
                               f"they were trained at, and the learner never abandoned a step")


def max_staleness(run_dir: Path) -> int | None:
    """The run's --max-staleness from its effective config (None when the run directory has none)."""
    try:
        config = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
        return int(config["buffer"]["max_staleness"])
    except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError):
        return None


def describe_report(report: AuditReport) -> list[str]:
    """The audit's counts as a user reads them: a batch trained again after a learner restart is said to be what it
    is (a step the final weights do not hold twice), not a double train."""
    lines = [f"accepted groups: {report.accepted_groups}  trained batches: {report.trained_batches}  "
             f"trained samples: {report.trained_samples}  pending groups: {report.pending_groups}  "
             f"final version: {report.final_version}"]
    if report.retrained_batches:
        batches = "1 batch" if report.retrained_batches == 1 else f"{report.retrained_batches} batches"
        lines.append(f"redone after a learner restart: {batches} that the learner had trained but not yet "
                     f"checkpointed when it died, trained again from its checkpoint; the final weights hold each "
                     f"batch once")
    if report.newer_token_samples:
        lines.append(f"samples with tokens from the weights of those lost steps (engines served them until the "
                     f"restarted learner pushed its own): {report.newer_token_samples}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    run_dir = parser.parse_args().run_dir
    result = audit(run_dir)
    print("\n".join(describe_report(result)))
    for problem in result.problems:
        print(f"PROBLEM: {problem}")
    certificate = certify(run_dir, prompts=prompt_verdict(run_dir), run_failed=recorded_run_failure(run_dir))
    print("\n".join(describe(certificate)))
    ok = result.ok and certificate["ok"]
    print("audit: OK" if ok else "audit: FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
