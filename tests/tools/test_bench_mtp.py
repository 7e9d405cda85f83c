"""The MTP benchmark still runs end to end, quietly, with its baseline in the same run (smoke only: its figures
are the benchmark's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.console import PROGRESS_BAR, env_without_quiet_switches

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.integration
def test_bench_mtp_quick_run_prints_its_table_and_writes_both_runs(tmp_path: Path) -> None:
    figures_path = tmp_path / "bench.json"
    completed = subprocess.run(
        [sys.executable, "-m", "tools.bench.mtp", "--quick", "--model-cache", str(tmp_path / "models"), "--json",
         str(figures_path)],
        cwd=REPO, env=env_without_quiet_switches(), capture_output=True, text=True, timeout=300, check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert not PROGRESS_BAR.search(completed.stderr + completed.stdout), completed.stderr[-3000:]
    assert "| no MTP |" in completed.stdout and "| MTP, 1 depth(s) |" in completed.stdout
    runs = json.loads(figures_path.read_text())["runs"]
    assert [len(run["step_seconds"]) for run in runs] == [3, 3]
    assert runs[0]["mtp_losses"] == [] and len(runs[1]["mtp_losses"]) == 3
    assert len(runs[1]["agreement_before"]) == len(runs[1]["agreement_after"]) == 1
