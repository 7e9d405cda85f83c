"""The router benchmark still runs end to end over engines in processes of their own, and with affinity a session's
turns find their history where the previous turn left it (smoke only: its figures are the benchmark's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.console import PROGRESS_BAR, env_without_quiet_switches

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.integration
@pytest.mark.timeout(400)
def test_bench_router_quick_run_prints_its_table_and_affinity_reuses_the_history(tmp_path: Path) -> None:
    figures_path = tmp_path / "bench.json"
    argv = ["--quick", "--engines", "2", "--episodes", "4", "--group", "2", "--turns", "2", "--answer", "4",
            "--repeats", "1"]
    completed = subprocess.run(
        [sys.executable, "-m", "tools.bench.router", *argv, "--model-cache", str(tmp_path / "models"),
         "--json", str(figures_path)],
        cwd=REPO, env=env_without_quiet_switches(), capture_output=True, text=True, timeout=380, check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert not PROGRESS_BAR.search(completed.stderr), completed.stderr[-3000:]
    assert all(name in completed.stdout for name in ("affinity", "round-robin", "no cache"))
    passes = {row["name"]: row for row in json.loads(figures_path.read_text())["passes"]}
    assert passes["affinity"]["reused_fraction"] >= 0.9  # each second turn on the engine that holds its first
    assert passes["no cache"]["reused_fraction"] == 0.0
    assert sum(passes["affinity"]["calls_per_engine"].values()) == 4 * 2
