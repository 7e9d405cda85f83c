"""The delta-sync benchmarks still run end to end on the tiny model (their figures are not asserted beyond what
the tiny model's training must show)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(module: str) -> str:
    completed = subprocess.run([sys.executable, "-m", module, "--quick", "--steps", "2"], capture_output=True,
                               text=True, timeout=300, check=False, cwd=ROOT)
    assert completed.returncode == 0, completed.stderr[-2000:]
    return completed.stdout


@pytest.mark.integration
def test_the_measurement_of_changed_elements_reports_each_wire_dtype() -> None:
    out = _run("tools.bench.weight_deltas")
    overall = re.search(r"^overall\s+[\d,]+\s+([\d.]+)%.*?\s+([\d.]+)%", out, re.MULTILINE)
    assert overall is not None, out
    assert float(overall.group(1)) > 50  # float32: an Adam step moves nearly every element
    assert "encodings chosen: dense" in out


@pytest.mark.integration
def test_the_push_benchmark_sends_deltas_after_the_first_push_against_a_full_baseline() -> None:
    out = _run("tools.bench.delta_push")
    assert "full (baseline)" in out and "(2 of 2 pushes were deltas)" in out
    assert "delta wins below a link of: float32:" in out
