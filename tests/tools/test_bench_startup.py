"""`tools/bench/startup.py`: the floor it measures the systems against is a real first step, and its table reads
medians and ratios to that floor (the Slipstream and TRL rows are the learning benchmark's runs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.bench.startup import FLOOR_PHASES, StartupRecord, run_one, summarise
from tools.make_arithmetic_data import make_arithmetic_data


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_the_floor_imports_loads_generates_and_trains_in_that_order(tmp_path: Path, tiny_model_path: Path) -> None:
    data = make_arithmetic_data(tmp_path / "data", max_operand=9, eval_size=10)
    record = run_one("floor", 0, tiny_model_path, data, tmp_path / "runs")
    times = [record.phases[phase] for phase in FLOOR_PHASES]
    assert 0 < times[0] < times[1] < times[2] < times[3] == record.first_step_s, record.phases


@pytest.mark.unit
def test_the_summary_takes_medians_and_divides_by_the_floors_median() -> None:
    def record(system: str, seconds: float) -> StartupRecord:
        phases = {phase: seconds * (index + 1) / len(FLOOR_PHASES) for index, phase in enumerate(FLOOR_PHASES)}
        return StartupRecord(system, 0, 1.0, seconds, phases if system == "floor" else {})

    summary = summarise([record("floor", 3.0), record("floor", 4.0), record("floor", 3.5),
                         record("sync", 5.0), record("sync", 4.2), record("sync", 7.0)])
    assert summary["floor"]["median_s"] == 3.5 and summary["floor"]["over_floor"] == 1.0
    assert summary["floor"]["imported_s"] == pytest.approx(3.5 / 4)
    assert summary["sync"] == {"median_s": 5.0, "min_s": 4.2, "max_s": 7.0, "over_floor": pytest.approx(5.0 / 3.5)}
