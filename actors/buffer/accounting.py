"""Where every prompt the buffer served went, read from its durable log: the prompt check of the run's certificate.

A run can lose prompts silently: a resume whose data cursor jumps passes prompts over, and the staleness bound
evicts long answers more often than short ones (they take longer, so they are older when their batch comes),
which biases what is trained toward short answers. The buffer's log (with the segments compactions archived) holds
every lease, acceptance, drop, eviction and batch, across restarts, so at the end of a run it says:

- skipped: prompts of the data order never leased while later ones were (a gap in an epoch's positions);
- per prompt group, its fate: trained, served but not trained yet, waiting in the pool, dropped (with the reason),
  or in flight (leased, no answer yet, or evicted and waiting to be generated again);
- samples: of the trained groups, the samples (episodes) trained and those left out (they failed, and their group
  trained on the others, `--failed-sample-policy leave_out`); a sample of a trained group that is neither fails the
  check. A sample here is what `--n-samples-per-prompt` asks for, an episode: one whose agent rewrote its context
  trained as several segments (`bus.episodes`) and counts once, its segments beside it (`trained_segments`);
- regenerated: evictions (with the staleness that caused them) and leases given again (a worker died, a lease
  expired);
- by response length (quartiles of the accepted groups' mean response length), how many groups were trained and
  how many evictions fell there, and the length bias: the mean response length of evicted groups against trained
  ones.

The verdict fails when prompts were skipped or a trained group's samples do not add up; everything else is
reported.
"""

from __future__ import annotations

import bisect
import itertools
import json
import statistics
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actors.buffer.left_out import left_out_episodes
from actors.buffer.log import BufferLog, archived_logs
from bus.codec import decode
from bus.episodes import count_episodes

LOG = Path("buffer") / "log.msgpack"
TRAINED = Path("metrics") / "trained_samples.jsonl"


@dataclass
class GroupFate:
    leases: int = 0
    evictions: int = 0
    accepted: bool = False  # in the pool now (its latest answer accepted, not evicted since)
    batch: int | None = None
    dropped: str | None = None
    mean_length: float | None = None  # of its latest accepted answer
    n_samples: int = 0  # asked of its lease (episodes)
    samples: int = 0  # of its latest accepted answer: the episodes that train
    segments: int = 0  # of its latest accepted answer: the samples that train, an episode's segments each one
    left_out: int = 0  # of its latest accepted answer: episodes that failed, and were left out of the group


@dataclass
class _History:
    groups: dict[str, GroupFate] = field(default_factory=dict)
    new_positions: dict[int, set[int]] = field(default_factory=dict)  # epoch -> positions leased for the first time
    eviction_staleness: Counter[int] = field(default_factory=Counter)
    evicted_lengths: list[float] = field(default_factory=list)  # the mean response length of each evicted answer
    complete: bool = True  # False when the log starts at a snapshot (its archives were deleted)

    def fate(self, group_id: str) -> GroupFate:
        return self.groups.setdefault(group_id, GroupFate())


def prompt_verdict(run_dir: Path) -> dict[str, Any]:
    """The prompt check of RUN_DIR/integrity.json (see the module docstring)."""
    log_path = run_dir / LOG
    if not log_path.exists():
        return {"verdict": "not run", "why": f"no buffer log at {log_path}"}
    history = _read(log_path)
    trained_through = _trained_through(run_dir / TRAINED)
    fates = Counter(_outcome(fate, trained_through) for fate in history.groups.values())
    skipped = _skipped(history.new_positions)
    samples = _samples(fate for fate in history.groups.values() if _outcome(fate, trained_through) == "trained")
    result: dict[str, Any] = {
        "verdict": "fail" if skipped or samples["unaccounted"] else "pass",
        "prompt_groups": len(history.groups),
        "fates": dict(sorted(fates.items())),
        "skipped": skipped,
        "samples": samples,
        "regenerated": {"evictions": sum(f.evictions for f in history.groups.values()),
                        "leased_again": sum(max(0, f.leases - 1 - f.evictions) for f in history.groups.values())},
        "eviction_staleness": {str(k): v for k, v in sorted(history.eviction_staleness.items())},
        "by_length": _by_length(history, trained_through),
    }
    if not history.complete:
        result["note"] = "the log starts at a compaction whose archives are gone: earlier prompts are not counted"
    return result


def _read(log_path: Path) -> _History:
    history = _History()
    paths = [*archived_logs(log_path), log_path]
    for index, path in enumerate(paths):
        for record in BufferLog.replay(path):
            kind = record["kind"]
            if kind == "snapshot":
                if index == 0 and not history.groups:  # the archives before it are gone: start from its cursor
                    history.complete = False
                    epoch, position = record["cursor"]
                    history.new_positions[epoch] = set(range(position))
                continue  # a compaction: the records before it (in the archives) already told the history
            group_id = record.get("group_id")
            if kind == "lease":
                for raw in record["groups"]:
                    group = decode(raw)
                    history.fate(group.group_id).leases += 1
                    history.fate(group.group_id).n_samples = group.n_samples
                for group_id in record["new"]:
                    epoch, position = (int(part) for part in group_id.split(":"))
                    history.new_positions.setdefault(epoch, set()).add(position)
            elif kind == "adopt":  # another policy's episode made it: never leased, as many samples as one
                history.fate(group_id).n_samples = decode(record["group"]).n_samples
            elif kind == "accept":
                fate = history.fate(group_id)
                samples = decode(record["group"]).samples
                fate.accepted, fate.dropped = True, None
                fate.mean_length = statistics.fmean(int(s.response_length) for s in samples) if samples else 0.0
                fate.samples, fate.segments = count_episodes(samples), len(samples)
                fate.left_out = left_out_episodes(record.get("left_out", ()))
            elif kind == "drop":
                fate = history.fate(group_id)
                fate.dropped, fate.accepted = record["reason"], False
            elif kind == "evict":
                fate = history.fate(group_id)
                fate.evictions += 1
                fate.accepted = False
                if fate.mean_length is not None:
                    history.evicted_lengths.append(fate.mean_length)
                if "staleness" in record:
                    history.eviction_staleness[int(record["staleness"])] += 1
            elif kind == "batch":
                for group_id in record["group_ids"]:
                    fate = history.fate(group_id)
                    fate.batch, fate.accepted = record["batch_id"], False
    return history


def _trained_through(path: Path) -> int:
    """The last batch the learner trained (0 if none): the batches up to it are in the final model's lineage."""
    last = 0
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                last = max(last, int(json.loads(line)["batch_id"]))
            except (ValueError, KeyError, TypeError):
                continue  # a line torn by a kill
    return last


def _outcome(fate: GroupFate, trained_through: int) -> str:
    if fate.batch is not None:
        return "trained" if fate.batch <= trained_through else "served, not trained yet"
    if fate.dropped is not None:
        return f"dropped: {fate.dropped}"
    if fate.accepted:
        return "waiting in the pool"
    return "in flight"


def _samples(trained: Iterable[GroupFate]) -> dict[str, int]:
    """The samples (episodes) of the trained groups: trained, left out, and those neither says (a log that lost
    one), and the segments the trained ones trained as. A group whose lease is in an archive since deleted is not
    counted: how many samples it asked for is unknown."""
    fates = [fate for fate in trained if fate.n_samples]
    count = {"trained": sum(f.samples for f in fates), "left_out": sum(f.left_out for f in fates)}
    return {**count, "unaccounted": sum(f.n_samples for f in fates) - count["trained"] - count["left_out"],
            "trained_segments": sum(f.segments for f in fates)}


def _skipped(new_positions: dict[int, set[int]]) -> int:
    """Positions of the data order passed over: in every epoch, each position below the last one leased must have
    been leased (an epoch is finished when the next one starts, so all of it up to its end counts)."""
    return sum(max(positions) + 1 - len(positions) for positions in new_positions.values() if positions)


def _by_length(history: _History, trained_through: int) -> dict[str, Any]:
    """Groups, trained groups and evictions per quartile of answer length, and evicted against trained lengths."""
    lengths = sorted(f.mean_length for f in history.groups.values() if f.mean_length is not None)
    if len(lengths) < 4:
        return {}
    edges = sorted(set(statistics.quantiles(lengths, n=4)))  # equal quartiles (many equal lengths) merge
    labels = [f"<= {edges[0]:.1f}", *(f"{a:.1f}-{b:.1f}" for a, b in itertools.pairwise(edges)), f"> {edges[-1]:.1f}"]
    buckets = [{"lengths": label, "groups": 0, "trained": 0, "evictions": 0} for label in labels]
    trained = []
    for fate in history.groups.values():
        if fate.mean_length is None:
            continue
        bucket = buckets[bisect.bisect_left(edges, fate.mean_length)]
        bucket["groups"] += 1
        if _outcome(fate, trained_through) == "trained":
            bucket["trained"] += 1
            trained.append(fate.mean_length)
    for length in history.evicted_lengths:
        buckets[bisect.bisect_left(edges, length)]["evictions"] += 1
    result: dict[str, Any] = {"buckets": buckets}
    if history.evicted_lengths and trained and statistics.fmean(trained) > 0:
        result["evicted_vs_trained_length"] = round(statistics.fmean(history.evicted_lengths)
                                                    / statistics.fmean(trained), 3)
    return result
