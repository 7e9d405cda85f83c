"""The end-of-run pictures and summary the launcher writes, read back from a run's own metric files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.runtime.run_report import plot_run, report_run, summarize

pytestmark = pytest.mark.unit


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def test_a_runs_metrics_become_two_pictures_and_a_summary_of_its_gain_and_staleness(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "metrics" / "train.jsonl", [
        {"step": 1, "time": 10.0, "rollout/reward_mean": 0.2, "staleness/hist_0": 6, "staleness/hist_1": 2},
        {"step": 2, "time": 21.5, "rollout/reward_mean": 0.7, "staleness/hist_1": 8},
    ])
    write_jsonl(tmp_path / "metrics" / "eval.jsonl", [
        {"step": 0, "time": 1.0, "eval/heldout/accuracy": 0.1},
        {"step": 2, "time": 22.0, "eval/heldout/accuracy": 0.85},
    ])
    written = plot_run(tmp_path)
    assert written == [tmp_path / "plots" / "curves.png", tmp_path / "plots" / "staleness.png"]
    assert all(path.read_bytes().startswith(b"\x89PNG") for path in written)
    summary = summarize(tmp_path)
    assert "learner steps: 2  wall-clock: 22s  final train reward: 0.700" in summary
    assert "staleness: 0: 38%, 1: 62%" in summary
    assert "eval/heldout/accuracy: 0.100 at version 0 -> 0.850 at version 2" in summary


def test_an_unreadable_run_is_reported_and_does_not_raise(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "train.jsonl").mkdir()  # a folder where the file should be
    report_run(tmp_path)
    assert "could not plot the run" in capsys.readouterr().err
