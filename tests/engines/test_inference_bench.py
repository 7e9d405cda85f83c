"""The engine benchmark still runs end to end (smoke only: speed is shown by the benchmark, not tested)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.console import PROGRESS_BAR, env_without_quiet_switches
from tools.bench import engine as bench_engine

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.integration
def test_bench_engine_quick_run_writes_its_figures_and_only_its_table(tmp_path: Path) -> None:
    """Run as a user runs it: a fresh process, building its model (transformers' save and load bars were
    interleaved with the table)."""
    figures_path = tmp_path / "bench.json"
    argv = ["--quick", "--prompts", "12", "--batch-size", "4", "--longest", "12"]
    completed = subprocess.run(
        [sys.executable, "-m", "tools.bench.engine", *argv, "--model-cache", str(tmp_path / "models"),
         "--json", str(figures_path)],
        cwd=REPO, env=env_without_quiet_switches(), capture_output=True, text=True, timeout=240, check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert not PROGRESS_BAR.search(completed.stderr), completed.stderr[-3000:]
    assert "TorchEngine (continuous batching)" in completed.stdout
    figures = json.loads(figures_path.read_text())
    assert figures["prompts"] == 12 and figures["batch_size"] == 4
    assert figures["engine_median"] > 0 and figures["baseline_median"] > 0
    assert figures["length_max"] <= 12


@pytest.mark.unit
def test_heavy_tailed_lengths_are_mostly_short_with_a_long_tail() -> None:
    lengths = bench_engine.heavy_tailed_lengths(5000, shortest=8, longest=512, alpha=1.1, rng=random.Random(0))
    lengths.sort()
    assert lengths[0] >= 8 and lengths[-1] == 512
    assert lengths[len(lengths) // 2] < 24  # median stays short
    assert lengths[int(len(lengths) * 0.99)] > 200  # the top percent is long
