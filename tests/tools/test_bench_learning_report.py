"""How `tools/bench/learning.py` turns snapshot curves into its verdicts (the runs themselves need TRL)."""

from __future__ import annotations

import pytest

from tools.bench.learning import RunRecord, summarise


def _run(system: str, seed: int, curve: list[tuple[int, float, float]]) -> RunRecord:
    return RunRecord(system=system, seed=seed, load_before=1.0, wall_s=60.0, startup_s=5.0, steps_per_s=4.0,
                     samples_per_s=1000.0, curve=curve)


@pytest.mark.unit
def test_the_time_to_a_target_is_interpolated_between_the_snapshots_either_side() -> None:
    run = _run("sync", 0, [(20, 10.0, 0.20), (40, 15.0, 0.30), (60, 20.0, 0.40), (80, 25.0, 0.38)])
    assert run.seconds_to(0.35) == pytest.approx(17.5)  # halfway from 0.30 to 0.40
    assert run.seconds_to(0.40) == pytest.approx(20.0)  # exactly on a snapshot
    assert run.seconds_to(0.10) == pytest.approx(10.0)  # reached at the first snapshot: nothing to interpolate
    assert run.seconds_to(0.41) is None


@pytest.mark.unit
def test_the_verdicts_compare_medians_over_seeds_and_pair_async_with_sync_by_seed() -> None:
    runs = [
        _run("trl", 0, [(20, 20.0, 0.2), (40, 40.0, 0.4)]),
        _run("trl", 1, [(20, 20.0, 0.3), (40, 40.0, 0.5)]),
        _run("sync", 0, [(20, 10.0, 0.2), (40, 20.0, 0.4), (60, 30.0, 0.45)]),
        _run("sync", 1, [(20, 10.0, 0.2), (40, 20.0, 0.3), (60, 30.0, 0.45)]),
        _run("async", 0, [(20, 8.0, 0.3), (40, 16.0, 0.5)]),
        _run("async", 1, [(20, 8.0, 0.1), (40, 16.0, 0.2)]),  # never reaches 0.35 nor sync's 0.45
    ]
    summary = summarise(runs, target=0.35, start_accuracy=0.2, metric="sampled")
    seconds = summary["median_seconds_to_target"]
    assert seconds["trl"] == pytest.approx((35.0 + 25.0) / 2)
    assert seconds["sync"] == pytest.approx((17.5 + 20.0 + 10.0 / 3) / 2)  # 0.35 a third of the way from 0.3
    assert seconds["async"] is None  # median of 10.0 and never: a run that never reached it is infinitely slow
    assert summary["sync_over_trl"] == pytest.approx(seconds["sync"] / 30.0)
    assert summary["async_over_trl"] is None
    assert summary["metric"] == "sampled"
    # async seed 0 reached sync seed 0's final 0.45 at 14 s of sync's 30; seed 1 never: the median is "never"
    assert summary["async_to_sync_final_over_sync_wall"] is None
