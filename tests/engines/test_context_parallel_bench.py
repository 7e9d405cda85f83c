"""The context-parallel benchmark still runs end to end, and its worlds compute the same step: the loss of the row is
the same whether one rank or two hold it (its memory and time figures are shown by the benchmark, not tested)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.console import PROGRESS_BAR, env_without_quiet_switches

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.integration
def test_bench_context_parallel_quick_run_prints_its_table_and_the_same_loss_at_each_size(tmp_path: Path) -> None:
    figures_path = tmp_path / "bench.json"
    completed = subprocess.run(
        [sys.executable, "-m", "tools.bench.context_parallel", "--quick", "--tokens", "256", "--cp", "1", "2",
         "--lora", "4", "--mmap-threshold", str(1 << 20), "--model-cache", str(tmp_path / "models"),
         "--json", str(figures_path)],
        cwd=REPO, env=env_without_quiet_switches(), capture_output=True, text=True, timeout=240, check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert not PROGRESS_BAR.search(completed.stderr), completed.stderr[-3000:]
    lines = completed.stdout.splitlines()
    assert lines[0].startswith("model: quick") and "a LoRA adapter of rank 4 trained" in lines[0]
    assert "glibc mmap threshold 1024 KiB" in lines[0]
    assert lines[1].startswith("activations: peak minus")
    assert lines[2].split()[:4] == ["tokens", "CP", "peak", "MiB"]
    assert [line.split()[:2] for line in lines[3:]] == [["256", "1"], ["256", "2"]]
    figures = json.loads(figures_path.read_text())
    assert figures["lora"] == 4 and figures["mmap_threshold"] == 1 << 20  # glibc's, fixed for the measurement
    one, two = figures["rows"]
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)
    for row in (one, two):
        assert row["peak_mib"] > 0 and row["short_peak_mib"] >= 0 and row["seconds"] > 0
