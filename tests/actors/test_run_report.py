"""The end-of-run pictures and summary the launcher writes, read back from a run's own metric files."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest

from actors.report.progress import describe, train_accuracy_key
from actors.report.run_report import curves, plot_run, report_run, summarize
from actors.runtime.metrics import read_metrics

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
        {"step": 0, "time": 1.0, "eval/heldout/accuracy": 0.1, "eval/heldout/response_length/median": 120.0},
        {"step": 2, "time": 22.0, "eval/heldout/accuracy": 0.85, "eval/heldout/response_length/median": 37.0,
         "eval/heldout/gain/mean_reward": 0.75, "eval/heldout/gain_se/mean_reward": 0.05,
         "eval/heldout/gain_prompts": 100, "eval/heldout/gain_since": 0,
         "eval/heldout/gain/reward/format_ok": 0.0, "eval/heldout/gain_se/reward/format_ok": 0.0,
         "eval/heldout/gain/reward/steps": 0.0, "eval/heldout/gain_se/reward/steps": 0.0},
    ])
    written = plot_run(tmp_path)
    assert written == [tmp_path / "plots" / "curves.png", tmp_path / "plots" / "staleness.png"]
    assert all(path.read_bytes().startswith(b"\x89PNG") for path in written)
    summary = summarize(tmp_path)
    assert "learner steps: 2  wall-clock: 22s  final train reward: 0.700" in summary
    assert "staleness: 0: 38%, 1: 62%" in summary
    assert "eval/heldout/accuracy: 0.100 at version 0 -> 0.850 at version 2" in summary
    assert "eval/heldout/response_length/median: 120 at version 0 -> 37 at version 2" in summary  # answers shortened
    assert ("eval/heldout/mean_reward gain, version 0 -> 2 (paired over 100 prompts): +0.750 ± 0.050 (+15.0 SE)"
            in summary)
    # numbers no prompt moved: one line for them all, not a "+0.000" line each
    assert "eval/heldout: reward/format_ok, reward/steps the same on every prompt, version 0 -> 2" in summary
    assert "format_ok gain" not in summary


def test_an_unreadable_run_is_reported_and_does_not_raise(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "train.jsonl").mkdir()  # a folder where the file should be
    report_run(tmp_path)
    assert "could not plot the run" in capsys.readouterr().err


def test_a_run_that_logged_no_step_plots_without_a_library_warning(tmp_path: Path) -> None:
    """A run that failed before its first step: matplotlib warned on the console that the legend had no lines."""
    (tmp_path / "metrics").mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        written = plot_run(tmp_path)
    assert curves([], []) == []
    assert all(path.read_bytes().startswith(b"\x89PNG") for path in written)


def test_the_plots_train_accuracy_is_the_progress_lines_acc_and_the_reward_has_its_own_panel(tmp_path: Path) -> None:
    """With partial credit the reward function's reward/correct is what "right" means, and the progress line shows
    it as `acc`: the plot must draw the same numbers, not the share of rewards of 1. The reward, 0 or 1 where the
    reward is exact, drew over the accuracy line; it has a panel of its own."""
    records = [{"step": 1, "time": 1.0, "rollout/reward_mean": 0.5, "rollout/accuracy": 0.0, "reward/correct": 0.5},
               {"step": 2, "time": 2.0, "rollout/reward_mean": 0.9, "rollout/accuracy": 0.5, "reward/correct": 0.75}]
    write_jsonl(tmp_path / "metrics" / "train.jsonl", records)
    write_jsonl(tmp_path / "metrics" / "eval.jsonl", [
        {"step": 2, "time": 2.5, "eval/heldout/accuracy": 0.25, "eval/heldout/reward/correct": 0.5}])
    train = read_metrics(tmp_path / "metrics" / "train.jsonl")
    by_step = {(curve.panel, curve.x, curve.label.split(":")[0]): curve for curve in curves(train, [])}
    accuracy = by_step["accuracy", "step", "train"]
    shown = [float(re.search(r" acc (\S+) ", describe(record, train_accuracy_key(train)))[1]) for record in train]
    assert accuracy.ys == shown == [0.5, 0.75]
    assert "reward/correct" in accuracy.label
    assert by_step["reward", "step", "train reward (mean)"].ys == [0.5, 0.9]
    evals = read_metrics(tmp_path / "metrics" / "eval.jsonl")
    (eval_curve,) = [c for c in curves(train, evals) if c.label.startswith("eval heldout") and c.x == "step"]
    assert eval_curve.ys == [0.5] and eval_curve.panel == "accuracy"


def test_without_reward_correct_the_accuracy_is_named_the_share_of_rewards_of_one(tmp_path: Path) -> None:
    train = [{"step": 1, "time": 1.0, "rollout/reward_mean": 1.0, "rollout/accuracy": 1.0}]
    (accuracy,) = [curve for curve in curves(train, []) if curve.panel == "accuracy" and curve.x == "step"]
    assert accuracy.ys == [1.0] and "share of rewards >= 1" in accuracy.label
    assert " acc 1.000 " in describe(train[0], train_accuracy_key(train))
