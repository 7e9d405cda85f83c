"""tools/bench/pipeline.py --quick through real launcher runs of the real actors, and the synthetic costs its
bound rests on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tools.sim.pipeline import LengthSampler, SimSpec

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    """One `--quick` benchmark (async and sync at 1 and 4 workers, each stage alone once), shared by the tests."""
    work = tmp_path_factory.mktemp("bench_pipeline")
    out = work / "figures.json"
    result = subprocess.run([sys.executable, "-m", "tools.bench.pipeline", "--quick", "--json", str(out),
                             "--keep-runs", str(work / "runs")], cwd=REPO, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
    return json.loads(out.read_text(encoding="utf-8")), result.stdout


def _runs(figures: dict[str, Any], mode: str) -> list[dict[str, Any]]:
    return [run for row in figures["rows"] for run in row["runs"][mode]]


@pytest.mark.system
@pytest.mark.timeout(300)
def test_quick_benchmark_measures_both_modes_and_both_bounds(quick_run: tuple[dict[str, Any], str]) -> None:
    figures, table = quick_run
    one, four = figures["rows"]
    assert (one["workers"], four["workers"]) == (1, 4)
    assert all(row[mode] > 0 for row in (one, four) for mode in ("async", "sync"))
    assert four["measured_bound"] == min(four["rollout_alone"], figures["trainer_alone"]["samples_per_s"])
    assert one["rollout_alone"] is None  # --quick measures the rollout stage alone at its largest scale only
    assert "fully-async" in table and "CPU cores" in table


@pytest.mark.system
@pytest.mark.timeout(300)
def test_the_runs_are_the_real_rollout_workers_and_learner_behind_sleeping_seams(
        quick_run: tuple[dict[str, Any], str]) -> None:
    figures, _ = quick_run
    run_dir = Path(_runs(figures, "async")[-1]["run_dir"])
    contexts = {path.stem: json.loads(path.read_text()) for path in (run_dir / "actors").glob("*.json")}
    assert contexts["learner"]["actor_class"] == "actors.learner.actor:Learner"
    assert {c["actor_class"] for name, c in contexts.items() if name.startswith("rollout-")} == {
        "actors.rollout.actor:RolloutWorker"}
    run = contexts["learner"]["settings"]["run"]
    assert (run["engine"]["rollout_engine"], run["trainer"]["train_backend"], run["weights"]["weight_transport"]) == (
        "tools.sim.pipeline:sleeping_engine", "tools.sim.pipeline:sleeping_trainer", "tools.sim.pipeline:VERSION_ONLY")
    steps = [json.loads(line) for line in (run_dir / "metrics" / "train.jsonl").read_text().splitlines()]
    # A step's row is written while its push may still run beside the next step (the row then shows the version
    # before); the next row's publish settles it first, so each row shows the previous row's version published.
    # The benchmark ends a run with SIGTERM, which may land during either of the last two pushes, and a stopping
    # learner abandons a push (its engines are stopping too).
    # None: no push committed yet; the engines serve the checkpoint they loaded, version 0 (a loaded machine can
    # write the first row before the initial push lands).
    committed = [step["weights/committed_version"] or 0 for step in steps]
    versions = [step["version"] for step in steps]
    assert all(shown >= version - 1 for shown, version in zip(committed[:-1], versions[:-1], strict=True))
    assert all(later >= version for later, version in zip(committed[1:-1], versions[:-2], strict=True))
    assert committed[-1] >= versions[-1] - 2


@pytest.mark.system
@pytest.mark.timeout(300)
def test_sync_runs_train_only_samples_of_the_current_version(quick_run: tuple[dict[str, Any], str]) -> None:
    figures, _ = quick_run
    assert [run["staleness_max"] for run in _runs(figures, "sync")] == [0, 0]


@pytest.mark.system
@pytest.mark.timeout(300)
def test_async_runs_never_train_past_the_staleness_bound(quick_run: tuple[dict[str, Any], str]) -> None:
    figures, _ = quick_run
    bound = figures["shape"]["async_staleness"]
    assert all(run["staleness_max"] <= bound for run in _runs(figures, "async"))


@pytest.mark.system
@pytest.mark.timeout(300)
def test_async_outpaces_sync_when_generation_and_training_overlap(quick_run: tuple[dict[str, Any], str]) -> None:
    # At 4 workers a sync batch waits for its slowest group and then for training; async overlaps the two.
    figures, _ = quick_run
    four = next(row for row in figures["rows"] if row["workers"] == 4)
    assert four["async"] > 1.3 * four["sync"]


@pytest.mark.unit
def test_analytic_group_time_matches_the_sampled_longest_response() -> None:
    spec = SimSpec(token_seconds=1.0)
    sampler = LengthSampler(spec, seed=[7])
    sampled = np.mean([sampler.draw(4).max() for _ in range(40_000)])
    assert spec.mean_group_seconds(4) == pytest.approx(sampled, rel=0.02)


@pytest.mark.unit
def test_unknown_key_in_the_spec_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "pipeline_sim.json").write_text(json.dumps({"token_seconds": 0.001, "tokens_per_s": 5}))
    with pytest.raises(ValueError, match=r"pipeline_sim\.json: unknown key\(s\) tokens_per_s"):
        SimSpec.read(tmp_path)
