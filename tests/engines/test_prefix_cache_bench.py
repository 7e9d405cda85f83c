"""The prefix cache benchmark still runs end to end (smoke only: its speed is shown by the benchmark, not tested)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.console import PROGRESS_BAR, env_without_quiet_switches

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.integration
def test_bench_prefix_cache_quick_run_prints_its_table_and_writes_its_figures(tmp_path: Path) -> None:
    figures_path = tmp_path / "bench.json"
    argv = ["--quick", "--episodes", "2", "--group", "2", "--turns", "2", "--answer", "4", "--threads", "1"]
    completed = subprocess.run(
        [sys.executable, "-m", "tools.bench.prefix_cache", *argv, "--model-cache", str(tmp_path / "models"),
         "--json", str(figures_path)],
        cwd=REPO, env=env_without_quiet_switches(), capture_output=True, text=True, timeout=240, check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert not PROGRESS_BAR.search(completed.stderr), completed.stderr[-3000:]
    assert "with prefix cache" in completed.stdout and "without prefix cache" in completed.stdout
    figures = json.loads(figures_path.read_text())
    assert figures["episodes"] == 2 and figures["turns"] == 2
    off, on = figures["prefill_per_turn_off"], figures["prefill_per_turn_on"]
    assert on[0] == off[0] and on[1] < off[1] / 2  # the second turn prefills what is new, not the history
    assert figures["identical_episodes"] == 2
