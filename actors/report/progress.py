"""The launcher's live progress line, read from the learner's metrics file.

Actors write metrics; the launcher only reads them, so the progress display costs the run nothing and works
the same when the learner is on another node with a shared run directory. On a terminal it is a rich progress
bar; elsewhere (CI, a log file) it prints one plain line per learner step. A resumed run's display starts where it
resumes: it says from which step, and shows none of the lines the run's earlier starts wrote.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REWARD_CORRECT = "reward/correct"  # the reward function's own word on which samples were right, where it gives one
REWARDS_OF_ONE = "rollout/accuracy"  # else: the share of samples whose reward reached 1


def train_accuracy_key(records: Iterable[dict[str, Any]]) -> str:
    """The train accuracy of a run, one quantity wherever it is shown (this line's `acc`, plots/curves.png): a
    reward that says which samples were right (reward/correct) is shown by it, since with partial credit a reward
    of 1 is not what "right" means."""
    return REWARD_CORRECT if any(REWARD_CORRECT in record for record in records) else REWARDS_OF_ONE


@dataclass(frozen=True)
class ProgressStart:
    """Where a launcher's progress display begins: `offset`, the bytes of metrics/train.jsonl that earlier starts
    of the run wrote (their steps are history, not progress), and `resumed_from`, the step of the checkpoint the
    learner resumes from (0: a new run)."""

    offset: int = 0
    resumed_from: int = 0

    @classmethod
    def of(cls, run_dir: Path, resumed_from: int) -> ProgressStart:
        """Taken before any actor starts, so that every line after `offset` is this start's."""
        path = train_metrics(run_dir)
        return cls(offset=path.stat().st_size if path.exists() else 0, resumed_from=resumed_from)


def train_metrics(run_dir: Path) -> Path:
    return run_dir / "metrics" / "train.jsonl"


def describe(record: dict[str, Any], accuracy: str | None = None) -> str:
    """One learner step; `accuracy` is the run's train accuracy key (`train_accuracy_key`), else this record's."""
    def number(key: str, fmt: str = ".3f") -> str:
        value = record.get(key)
        return "-" if value is None else format(value, fmt)

    accuracy = accuracy or train_accuracy_key([record])
    # what distillation and a critic are doing, when the run has them: the KL to the teacher is the signal a
    # zero-reward distillation run shows progress by
    extras = "".join(f"{label} {number(key)} " for label, key in (("kl-to-teacher", "opd/reverse_kl"),
                                                                  ("critic-ev", "critic/explained_variance"))
                     if key in record)
    return (f"step {record.get('step')} v{record.get('version', '-')} "
            f"reward {number('rollout/reward_mean')} acc {number(accuracy)} {extras}"
            f"stale max {number('staleness/max', '.0f')} mean {number('staleness/mean', '.2f')} "
            f"{number('throughput/samples_per_s', '.1f')} samples/s")


async def follow_progress(run_dir: Path, total_steps: int, stop: asyncio.Event,
                          start: ProgressStart = ProgressStart()) -> None:
    path = train_metrics(run_dir)
    offset = start.offset
    interactive = sys.stderr.isatty()
    progress = task = None
    accuracy = REWARDS_OF_ONE
    resumed = f"resumed from step {start.resumed_from} of {total_steps}" if start.resumed_from else ""
    if interactive:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        progress = Progress(TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            TextColumn("{task.description}"), transient=False)
        progress.start()
        waiting = f"{resumed}, waiting for its next batch" if resumed else "waiting for the first batch"
        task = progress.add_task(waiting, total=total_steps, completed=start.resumed_from)
    elif resumed:
        print(f"[progress] {resumed}", file=sys.stderr, flush=True)
    try:
        while True:
            last_look = stop.is_set()  # the run is over: show what its last second wrote, then end
            if path.exists():
                with path.open(encoding="utf-8") as handle:
                    handle.seek(offset)
                    chunk = handle.read()
                complete = chunk[: chunk.rfind("\n") + 1]
                offset += len(complete.encode("utf-8"))
                for line in complete.splitlines():
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    if REWARD_CORRECT in record:  # from here on, as the plots show the run (train_accuracy_key)
                        accuracy = REWARD_CORRECT
                    if progress is not None:
                        progress.update(task, completed=record.get("step", 0),
                                        description=describe(record, accuracy))
                    else:
                        print(f"[progress] {describe(record, accuracy)}", file=sys.stderr, flush=True)
            if last_look:
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
    finally:
        if progress is not None:
            progress.stop()
