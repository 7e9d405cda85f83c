"""tools/experiments/staleness.py: the --quick sweep runs end to end, plus its bookkeeping on hand-made curves."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.experiments.staleness import grpo_arguments, override_flags, parse_arguments
from tools.experiments.staleness_results import (
    Cell,
    RunResult,
    learner_origin,
    load_results,
    mean_curve,
    read_reward_steps,
    split_by_load,
    summarize,
    time_to_reach,
    trailing_mean,
)

REPO = Path(__file__).resolve().parents[2]


def finished_run(
    staleness: int, correction: str, seed: int, curve: list[tuple[int, float, float]], load: float = 2.0
) -> RunResult:
    return RunResult(
        max_staleness=staleness,
        correction=correction,
        seed=seed,
        run_dir="x",
        returncode=0,
        process_seconds=curve[-1][1] + 5,
        wall_clock=curve[-1][1],
        final_accuracy=curve[-1][2],
        curve=curve,
        mean_load=load,
    )


def heldout(run: RunResult) -> list[tuple[int, float, float]]:
    return run.curve


@pytest.mark.system
@pytest.mark.timeout(240)
def test_quick_sweep_writes_table_json_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    plot = tmp_path / "accuracy.png"
    completed = subprocess.run(
        [
            sys.executable,
            "-m", "tools.experiments.staleness",
            "--quick",
            "--workdir",
            str(tmp_path / "runs"),
            "--cache-dir",
            str(tmp_path / "cache"),
            "--json",
            str(out),
            "--plot",
            str(plot),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=230,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    assert "| 0 | tis | 1 |" in completed.stdout and "| 2 | tis | 1 |" in completed.stdout
    assert "final held-out accuracy" in completed.stdout and "final train reward" in completed.stdout
    payload = json.loads(out.read_text())
    runs = payload["runs"]
    assert [(r["max_staleness"], r["correction"], r["error"]) for r in runs] == [(0, "tis", None), (2, "tis", None)]
    for run in runs:
        versions = [point[0] for point in run["curve"]]
        assert versions[0] == 0 and versions[-1] == 6  # the pre-training round and the final model
        assert 0.0 <= run["final_accuracy"] <= 1.0 and run["wall_clock"] > 0
        assert [point[0] for point in run["reward_steps"]] == list(range(1, 7))
    async_run = runs[1]
    assert async_run["mean_staleness"] > 0  # staleness 2 really ran off-policy
    sync_cell = next(c for c in payload["summaries"][0]["cells"] if c["cell"]["max_staleness"] == 0)
    assert sync_cell["wall_clock_ratio"] == pytest.approx(1.0)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.unit
def test_time_to_reach_is_the_first_round_at_or_above_target() -> None:
    curve = [(0, 1.0, 0.40), (50, 10.0, 0.62), (100, 20.0, 0.55), (150, 30.0, 0.70)]
    assert time_to_reach(curve, 0.60) == 10.0
    assert time_to_reach(curve, 0.70) == 30.0


@pytest.mark.unit
def test_time_to_reach_is_none_when_the_target_is_never_reached() -> None:
    assert time_to_reach([(0, 1.0, 0.40), (50, 10.0, 0.5)], 0.6) is None


@pytest.mark.unit
def test_sync_runs_of_both_corrections_are_pooled_into_the_target() -> None:
    results = [
        finished_run(0, "none", 1, [(0, 0.0, 0.5), (100, 100.0, 0.6)]),
        finished_run(0, "tis", 1, [(0, 0.0, 0.5), (100, 80.0, 0.7)]),
        finished_run(2, "tis", 1, [(0, 0.0, 0.5), (50, 27.0, 0.66), (100, 50.0, 0.64)]),
    ]
    summary = summarize(results, heldout, "accuracy")
    assert summary.target == pytest.approx(0.65) and summary.sync_wall_clock == pytest.approx(90.0)
    async_tis = next(c for c in summary.cells if c.cell.max_staleness == 2)
    assert async_tis.time_to_target_mean == 27.0 and async_tis.target_ratio == pytest.approx(0.3)
    assert async_tis.versions_to_target_mean == 50 and async_tis.wall_clock_ratio == pytest.approx(50.0 / 90.0)


@pytest.mark.unit
def test_failed_runs_are_left_out_of_their_cell_summary() -> None:
    failed = RunResult(
        max_staleness=2,
        correction="tis",
        seed=2,
        run_dir="x",
        returncode=1,
        process_seconds=3.0,
        error="launcher exit 1",
    )
    results = [
        finished_run(0, "tis", 1, [(0, 0.0, 0.5), (100, 80.0, 0.7)]),
        finished_run(2, "tis", 1, [(0, 0.0, 0.5), (100, 40.0, 0.5)]),
        failed,
    ]
    async_tis = next(c for c in summarize(results, heldout, "accuracy").cells if c.cell.max_staleness == 2)
    assert async_tis.runs == 1 and async_tis.final_mean == pytest.approx(0.5)


@pytest.mark.unit
def test_mean_curve_averages_seeds_round_by_round() -> None:
    runs = [
        finished_run(1, "tis", 1, [(0, 0.0, 0.4), (50, 10.0, 0.6)]),
        finished_run(1, "tis", 2, [(0, 2.0, 0.6), (50, 14.0, 0.8)]),
    ]
    assert mean_curve([r.curve for r in runs]) == [pytest.approx((1.0, 0.5)), pytest.approx((12.0, 0.7))]


@pytest.mark.unit
def test_trailing_mean_starts_once_a_full_window_is_available() -> None:
    steps = [(v, float(v), value) for v, value in enumerate([0.0, 1.0, 0.0, 1.0, 1.0], start=1)]
    assert trailing_mean(steps, 2) == [(2, 2.0, 0.5), (3, 3.0, 0.5), (4, 4.0, 0.5), (5, 5.0, 1.0)]
    assert trailing_mean(steps[:2], 25) == [(2, 2.0, 0.5)]  # shorter than the window: the whole run


@pytest.mark.unit
def test_a_lowest_point_reports_a_collapse_the_final_value_hides() -> None:
    results = [
        finished_run(0, "none", 1, [(0, 0.0, 0.5), (100, 100.0, 0.6)]),
        finished_run(4, "none", 1, [(0, 0.0, 0.5), (50, 20.0, 0.2), (100, 40.0, 0.6)]),
    ]
    stale = next(c for c in summarize(results, heldout, "accuracy").cells if c.cell.max_staleness == 4)
    assert stale.final_mean == pytest.approx(0.6) and stale.lowest_mean == pytest.approx(0.2)


@pytest.mark.unit
def test_runs_over_the_load_limit_are_left_out_and_named() -> None:
    calm = finished_run(0, "tis", 1, [(0, 0.0, 0.5), (100, 80.0, 0.7)], load=3.0)
    busy = finished_run(0, "tis", 2, [(0, 0.0, 0.5), (100, 300.0, 0.7)], load=45.0)
    assert split_by_load([calm, busy], 10.0) == ([calm], [busy])
    assert split_by_load([calm, busy], None) == ([calm, busy], [])


@pytest.mark.unit
def test_override_flags_replaces_values_and_switches() -> None:
    base = ["--lr", "3e-4", "--max-staleness", "2", "--no-use-decoupled-ppo", "--seed", "1"]
    result = override_flags(base, {"--max-staleness": "0", "--no-use-decoupled-ppo": None, "--use-decoupled-ppo": ""})
    assert result == ["--lr", "3e-4", "--seed", "1", "--max-staleness", "0", "--use-decoupled-ppo"]


@pytest.mark.unit
def test_the_rollout_batch_size_reaches_every_runs_flags() -> None:
    """--quick shrinks the recipe's 32 prompts a step to 8; a full sweep keeps the recipe's."""
    quick, full = parse_arguments(["--quick"]), parse_arguments([])
    assert (quick.rollout_batch_size, full.rollout_batch_size) == (8, 32)
    flags = grpo_arguments(Cell(2, "tis"), 1, num_rollout=6, eval_interval=3, rollout_workers=1,
                           rollout_batch_size=quick.rollout_batch_size, decoupled_ppo=True)
    assert flags.count("--rollout-batch-size") == 1 and flags[flags.index("--rollout-batch-size") + 1] == "8"


@pytest.mark.unit
def test_a_sweep_without_the_synchronous_reference_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_arguments(["--staleness", "1", "2"])
    assert "--staleness must include 0" in capsys.readouterr().err


@pytest.mark.unit
def test_a_malformed_results_file_names_the_file_and_the_run(tmp_path: Path) -> None:
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"runs": [{"max_staleness": 0}]}))
    with pytest.raises(ValueError, match=r"results.json: runs\[0\]"):
        load_results(path)


@pytest.mark.unit
def test_the_sweeps_clock_is_the_learners_and_leaves_start_up_out(tmp_path: Path) -> None:
    """Metrics `time` is the run's clock, start-up included (20 s here); the sweep's ratios count from the learner's
    start, as docs/experiments.md says."""
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "learner.jsonl").write_text(
        json.dumps({"event": "registered", "timestamp": "2026-01-01T00:00:19.000000Z"}) + "\n"
        + json.dumps({"event": "actor started", "timestamp": "2026-01-01T00:00:20.000000Z"}) + "\n")
    origin = learner_origin(tmp_path)
    train = [{"step": 1, "version": 1, "time": 21.5, "wall": origin + 1.5, "rollout/reward_mean": 0.25}]
    assert read_reward_steps(train, origin) == [(1, 1.5, 0.25)]
