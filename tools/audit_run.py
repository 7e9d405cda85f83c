"""Audit a run directory: was every accepted sample trained exactly once? `python tools/audit_run.py RUN_DIR`.

Sources: the buffer's durable log with its archived segments (what was accepted, evicted, put in which batch,
committed) and the learner's `metrics/trained_samples.jsonl` (what it trained, batch by batch; a learner that
resumed from a checkpoint trains the batches after it again, and the last record of a batch id is the one in the
final model's lineage).

A run passes when the lineage trains batches 1..N once each, every trained batch holds exactly the groups the
buffer put in it, no sample appears in two batches, and every accepted group is either trained or still
waiting in the buffer (nothing accepted was lost).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from actors.buffer.log import BufferLog, archived_logs


@dataclass
class AuditReport:
    accepted_groups: int = 0
    trained_batches: int = 0
    trained_samples: int = 0
    pending_groups: int = 0
    retrained_batches: int = 0  # batches trained again after a learner restart (expected, not an error)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def audit(run_dir: Path) -> AuditReport:
    report = AuditReport()
    accepted: set[str] = set()
    ever_accepted: set[str] = set()
    batches: dict[int, list[str]] = {}
    log_path = run_dir / "buffer" / "log.msgpack"
    history = (record for path in [*archived_logs(log_path), log_path] for record in BufferLog.replay(path))
    for record in history:
        kind = record["kind"]
        if kind == "accept":
            accepted.add(record["group_id"])
            ever_accepted.add(record["group_id"])
        elif kind == "evict":
            accepted.discard(record["group_id"])  # regenerated: only a later acceptance counts
        elif kind == "batch":
            batches[record["batch_id"]] = list(record["group_ids"])
    report.accepted_groups = len(accepted | {g for groups in batches.values() for g in groups})

    lineage: dict[int, list[str]] = {}
    path = run_dir / "metrics" / "trained_samples.jsonl"
    for line in path.read_text(encoding="utf-8").splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line torn by kill -9 of the learner
        if record["batch_id"] in lineage:
            report.retrained_batches += 1
        lineage[record["batch_id"]] = record["sample_ids"]

    report.trained_batches = len(lineage)
    if sorted(lineage) != list(range(1, len(lineage) + 1)):
        report.problems.append(f"trained batch ids are not 1..{len(lineage)}: {sorted(lineage)}")
    owner: dict[str, int] = {}
    for batch_id, sample_ids in sorted(lineage.items()):
        for sample_id in sample_ids:
            if sample_id in owner:
                report.problems.append(f"sample {sample_id} trained in batches {owner[sample_id]} and {batch_id}")
            owner[sample_id] = batch_id
        trained_groups = sorted({sample_id.rsplit("/", 1)[0] for sample_id in sample_ids})
        if batch_id not in batches:
            report.problems.append(f"batch {batch_id} was trained but the buffer log never assembled it")
        elif trained_groups != sorted(batches[batch_id]):
            report.problems.append(f"batch {batch_id}: trained groups {trained_groups} != assembled "
                                   f"{sorted(batches[batch_id])}")
    report.trained_samples = len(owner)
    in_batches = {g for groups in batches.values() for g in groups}
    never_accepted = in_batches - ever_accepted
    if never_accepted:
        report.problems.append(f"groups batched without being accepted: {sorted(never_accepted)[:10]}")
    # Accepted groups not yet in a batch, and batches assembled but not trained when the run ended, are still
    # in the buffer's log: pending, not lost. Everything else was checked batch by batch above.
    untrained = [g for b, groups in batches.items() if b not in lineage for g in groups]
    report.pending_groups = len(accepted - in_batches) + len(untrained)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    result = audit(parser.parse_args().run_dir)
    print(f"accepted groups: {result.accepted_groups}  trained batches: {result.trained_batches}  "
          f"trained samples: {result.trained_samples}  pending groups: {result.pending_groups}  "
          f"batches retrained after a learner restart: {result.retrained_batches}")
    for problem in result.problems:
        print(f"PROBLEM: {problem}")
    print("audit: OK" if result.ok else "audit: FAILED")
    sys.exit(0 if result.ok else 1)


if __name__ == "__main__":
    main()
