"""The launcher's live progress line, read from the learner's metrics file.

Actors write metrics; the launcher only reads them, so the progress display costs the run nothing and works
the same when the learner is on another node with a shared run directory. On a terminal it is a rich progress
bar; elsewhere (CI, a log file) it prints one plain line per learner step. A resumed run's display starts where it
resumes: it says from which step, and shows none of the lines the run's earlier starts wrote. A run of several
policies shows each policy's learner: a bar per policy, or its lines named by the policy.
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


@dataclass(frozen=True)
class Followed:
    """One learner the display follows: its run directory (a policy's own in a run of several), its steps, where
    its display begins, and its policy (None: the run's one learner, shown as it always was)."""

    run_dir: Path
    total_steps: int
    start: ProgressStart = ProgressStart()
    policy: str | None = None


async def follow_progress(run_dir: Path, total_steps: int, stop: asyncio.Event,
                          start: ProgressStart = ProgressStart()) -> None:
    await follow_learners([Followed(run_dir, total_steps, start)], stop)


async def follow_learners(learners: list[Followed], stop: asyncio.Event) -> None:
    """Show each learner's steps as its metrics file grows, until `stop`, and then what its last second wrote."""
    offsets = [learner.start.offset for learner in learners]
    accuracies = [REWARDS_OF_ONE] * len(learners)
    progress = None
    tasks = []
    if sys.stderr.isatty():
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        progress = Progress(TextColumn("[bold]{task.fields[name]}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), TextColumn("{task.description}"), transient=False)
        progress.start()
        for learner in learners:
            resumed = _resumed(learner)
            waiting = f"{resumed}, waiting for its next batch" if resumed else "waiting for the first batch"
            tasks.append(progress.add_task(waiting, total=learner.total_steps, completed=learner.start.resumed_from,
                                           name=_named("training", learner.policy)))
    else:
        for learner in learners:
            if _resumed(learner):
                print(f"[progress] {_named('', learner.policy)}{_resumed(learner)}", file=sys.stderr, flush=True)
    try:
        while True:
            last_look = stop.is_set()  # the run is over: show what its last second wrote, then end
            for index, learner in enumerate(learners):
                records, offsets[index] = _new_records(train_metrics(learner.run_dir), offsets[index])
                for record in records:
                    if REWARD_CORRECT in record:  # from here on, as the plots show the run (train_accuracy_key)
                        accuracies[index] = REWARD_CORRECT
                    line = describe(record, accuracies[index])
                    if progress is not None:
                        progress.update(tasks[index], completed=record.get("step", 0), description=line)
                    else:
                        print(f"[progress] {_named('', learner.policy)}{line}", file=sys.stderr, flush=True)
            if last_look:
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
    finally:
        if progress is not None:
            progress.stop()


def _new_records(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """The complete lines written to `path` after `offset`, and the offset after them."""
    if not path.exists():
        return [], offset
    with path.open(encoding="utf-8") as handle:
        handle.seek(offset)
        chunk = handle.read()
    complete = chunk[: chunk.rfind("\n") + 1]
    records = []
    for line in complete.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records, offset + len(complete.encode("utf-8"))


def _resumed(learner: Followed) -> str:
    start = learner.start.resumed_from
    return f"resumed from step {start} of {learner.total_steps}" if start else ""


def _named(text: str, policy: str | None) -> str:
    """`text` for the run's one learner; with the policy's name for a policy's ("training solver", "solver: ")."""
    if policy is None:
        return text
    return f"{text} {policy}" if text else f"{policy}: "
