"""tools/chaos/soak.py's measurement through a short real run (launcher.py, the real actors, sleeping compute), and the
pieces it reads the run with. The soak's targets (growth < 10%, no slowdown, no stall) are the benchmark's to
judge over its minutes; here only that every figure is measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.bench.pipeline import STOPPED_BY_US, PipelineShape
from tools.chaos.soak import SoakOptions, memory_by_role, run_soak, soak_table, to_json
from tools.run_watch import JsonlTail, RunWatch, Sample


@pytest.mark.system
@pytest.mark.timeout(240)
def test_a_short_soak_measures_memory_per_role_steps_and_restarts(tmp_path: Path) -> None:
    # Small batches, so 2 workers train a step every second or so and the gaps between steps are measured.
    options = SoakOptions(workers=2, duration_s=8.0, sample_s=1.0, shape=PipelineShape(groups_per_batch=4))
    result = run_soak(options, tmp_path)
    table = soak_table(result)
    assert result.steps_total > result.steps_at_warmup > 0, table
    assert 0 < result.median_gap_s <= result.longest_gap_s < options.duration_s, table
    assert result.rate_first > 0 and result.rate_last > 0, table
    roles = {m.role.split(" ", 1)[0] for m in result.memory}
    assert roles >= {"controller", "buffer", "learner", "reward", "rollout", "launcher", "total"}, table
    assert all(m.warmup_mib > 10 and m.end_mib > 10 for m in result.memory), table  # a Python process is > 10 MiB
    assert next(m for m in result.memory if m.role.startswith("rollout (median")).processes == 2
    assert result.restarts == {}, table
    assert result.exit_code in STOPPED_BY_US and result.leftover == [], table
    figures = json.loads(json.dumps(to_json(result), allow_nan=False))
    assert figures["timeline"][-1]["steps"] == result.steps_total


@pytest.mark.unit
def test_a_torn_last_line_is_read_once_it_is_complete(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    tail = JsonlTail(path)
    assert tail.read() == []  # not written yet
    path.write_text('{"a": 1}\n{"b":')
    assert tail.read() == [{"a": 1}]
    with path.open("a") as handle:
        handle.write(' 2}\n')
    assert tail.read() == [{"b": 2}]
    assert tail.read() == []


@pytest.mark.unit
def test_a_restarted_actor_is_not_compared_with_its_predecessor() -> None:
    warmup = Sample(t=60.0, rss_kib={"learner": 100_000, "buffer": 50_000}, pids={"learner": 10, "buffer": 11},
                    steps=5, load=1.0)
    end = Sample(t=600.0, rss_kib={"learner": 300_000, "buffer": 51_200}, pids={"learner": 99, "buffer": 11},
                 steps=500, load=1.0)
    rows = {m.role: m for m in memory_by_role(warmup, end)}
    assert "learner" not in rows  # a new process: counted as a restart, not as growth
    assert rows["buffer"].growth == pytest.approx(0.024)
    assert rows["total"].processes == 1


@pytest.mark.unit
def test_restarts_are_starts_beyond_the_first_or_crashes_not_yet_restarted(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "launcher-0.jsonl"
    log.parent.mkdir()
    events = [("actor process started", "buffer", 10), ("actor process started", "learner", 11),
              ("actor crashed; restarting", "learner", None), ("actor process started", "learner", 12),
              ("actor crashed; restarting", "buffer", None), ("actor ignored SIGTERM; killing", "learner", None)]
    log.write_text("".join(json.dumps({"event": event, "actor": actor, **({"pid": pid} if pid else {})}) + "\n"
                           for event, actor, pid in events))
    watch = RunWatch(tmp_path, launcher_pid=1)
    watch.update()
    assert watch.restarts() == {"learner": 1, "buffer": 1}
    assert watch.pids == {"buffer": 10, "learner": 12}  # the latest process per actor
    assert watch.killed == ["learner"]
