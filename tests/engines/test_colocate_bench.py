"""The colocation memory benchmark: its turn arithmetic, and its turns run end to end on the CPU (the saving itself
needs a GPU's caching allocator: docs/colocate.md has the H200 figures)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.console import PROGRESS_BAR, env_without_quiet_switches
from tools.bench.colocate import Turn, device_peak

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30


@pytest.mark.unit
def test_the_device_peak_adds_the_resting_process_as_it_was_at_that_turn() -> None:
    loaded = {"learner": 1 * GIB, "engine": 1 * GIB}
    turns = [Turn("engine", 3 * GIB, 1 * GIB), Turn("learner", 9 * GIB, 8 * GIB), Turn("engine", 3 * GIB, 1 * GIB)]
    # the engine's second turn sits beside a learner that kept 8 GiB: 3 + 8
    assert device_peak(turns, loaded) == 11 * GIB
    handed_over = [Turn("engine", 3 * GIB, 1 * GIB), Turn("learner", 9 * GIB, 1 * GIB),
                   Turn("engine", 3 * GIB, 1 * GIB)]
    assert device_peak(handed_over, loaded) == 10 * GIB  # the learner's own turn, beside the engine at rest


@pytest.mark.integration
def test_both_modes_take_their_turns_in_two_processes(tmp_path: Path) -> None:
    output = tmp_path / "colocate.json"
    completed = subprocess.run(
        [sys.executable, "-m", "tools.bench.colocate", "--cpu", "--quick", "--rounds", "1",
         "--json", str(output)],
        capture_output=True, text=True, timeout=180, check=False, cwd=ROOT, env=env_without_quiet_switches(),
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert not PROGRESS_BAR.search(completed.stderr), completed.stderr[-2000:]  # each turn loaded with a bar
    rows = {row["mode"]: row for row in json.loads(output.read_text())["rows"]}
    assert set(rows) == {"baseline: keeps its memory", "colocated"}
    for row in rows.values():
        assert row["device_peak"] >= max(row["learner_peak"], row["engine_peak"], row["generation_peak"]) > 0
    assert "colocated device peak" in completed.stdout
