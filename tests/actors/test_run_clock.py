"""One run clock: metrics `time` counts from the run's start, across actor restarts and resumed runs, and the
end-of-run summary prints the run's wall-clock in a form that a run of a few seconds does not turn into "0s"."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from actors.report.run_clock import RunClock, format_duration, run_seconds, run_starts
from actors.report.run_report import summarize
from actors.runtime.base import Actor
from actors.runtime.context import ActorContext
from actors.runtime.metrics import last_record, read_metrics
from launcher import on_clock

pytestmark = pytest.mark.unit


class Recorder(Actor):
    role = "recorder"


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        handle.writelines(json.dumps(record) + "\n" for record in records)


def started_actor(run_dir: Path, clock: RunClock) -> Recorder:
    """An actor as the supervisor starts it, and again when it restarts it: from the context file the launcher
    wrote, read back the way `actors.runtime.main` reads it."""
    context = on_clock(ActorContext(actor_id="learner", role="learner", actor_class="x:Y", node_rank=0,
                                    head_address="tcp://127.0.0.1:1", run_dir=run_dir), clock)
    return Recorder(ActorContext.from_json(context.to_json()))


def test_a_restarted_actors_metrics_go_on_with_the_runs_time(tmp_path: Path) -> None:
    clock = RunClock.start(tmp_path, now=time.time() - 100)  # the run started 100 s ago
    for step in (1, 2):  # the first learner writes step 1 and dies; its restart writes step 2
        actor = started_actor(tmp_path, clock)
        writer = actor.open_metrics("train")
        writer.write(step, {"rollout/reward_mean": 0.5})
        writer.close()
        actor.zmq.destroy(linger=0)
    times = [record["time"] for record in read_metrics(tmp_path / "metrics" / "train.jsonl")]
    assert 100 <= times[0] <= times[1] < 200, times


def test_a_resumed_run_continues_from_where_the_stopped_one_stopped(tmp_path: Path) -> None:
    """Not from 0 (the plot would draw backwards), not from the first start (the night it sat stopped is no run
    time): from the 150 s the first start ran."""
    first = RunClock.start(tmp_path, now=1_000.0)
    assert first.stop(now=1_150.0) == 150.0
    second = RunClock.start(tmp_path, now=90_000.0)
    assert second.seconds(now=90_010.0) == pytest.approx(160.0)
    assert run_starts(tmp_path) == 2


def test_a_run_whose_launcher_was_killed_resumes_from_its_last_metrics(tmp_path: Path) -> None:
    RunClock.start(tmp_path, now=1_000.0)  # never stopped: its launcher was killed -9
    write_jsonl(tmp_path / "metrics" / "train.jsonl", [{"step": 1, "time": 30.0}, {"step": 2, "time": 42.5}])
    write_jsonl(tmp_path / "metrics" / "actors.jsonl", [{"step": 0, "time": 44.0}])
    with (tmp_path / "metrics" / "train.jsonl").open("a") as handle:
        handle.write('{"step": 3, "ti')  # torn by the kill
    assert RunClock.start(tmp_path, now=5_000.0).seconds(now=5_000.0) == pytest.approx(44.0)


def test_the_last_record_of_a_long_file_is_read_from_its_end(tmp_path: Path) -> None:
    path = tmp_path / "actors.jsonl"
    padding = "x" * 100_000  # each line longer than the first read of the file's end
    write_jsonl(path, [{"step": step, "time": float(step), "pad": padding} for step in range(5)])
    assert last_record(path)["step"] == 4
    assert last_record(tmp_path / "missing.jsonl") is None


@pytest.mark.parametrize(("seconds", "shown"), [(3.4, "3.4s"), (0.04, "0.0s"), (9.96, "10s"), (47.2, "47s"),
                                                (59.6, "1m 00s"), (154.0, "2m 34s"), (3725.0, "1h 02m 05s")])
def test_a_duration_reads_in_the_unit_that_fits_it(seconds: float, shown: str) -> None:
    assert format_duration(seconds) == shown


def test_the_summary_prints_the_runs_wall_clock_not_the_learners(tmp_path: Path) -> None:
    """The learner restarted, so its records alone would say 47 s: the run ran 154 s."""
    RunClock.start(tmp_path, now=1_000.0).stop(now=1_154.2)
    write_jsonl(tmp_path / "metrics" / "train.jsonl", [{"step": 4, "time": 47.0, "rollout/reward_mean": 0.5}])
    assert "learner steps: 4  wall-clock: 2m 34s  final train reward: 0.500" in summarize(tmp_path)


def test_a_tiny_runs_summary_does_not_say_zero_seconds(tmp_path: Path) -> None:
    RunClock.start(tmp_path, now=1_000.0).stop(now=1_003.4)
    write_jsonl(tmp_path / "metrics" / "train.jsonl", [{"step": 1, "time": 2.9, "rollout/reward_mean": 0.25}])
    assert "wall-clock: 3.4s " in summarize(tmp_path)


def test_a_resumed_runs_summary_says_its_time_spans_starts(tmp_path: Path) -> None:
    RunClock.start(tmp_path, now=1_000.0).stop(now=1_100.0)
    RunClock.start(tmp_path, now=50_000.0).stop(now=50_050.0)
    write_jsonl(tmp_path / "metrics" / "train.jsonl", [{"step": 9, "time": 140.0, "rollout/reward_mean": 0.5}])
    assert run_seconds(tmp_path) == pytest.approx(150.0)
    assert "wall-clock: 2m 30s over 2 starts (stopped time not counted)" in summarize(tmp_path)
