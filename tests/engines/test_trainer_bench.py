"""The packing benchmark still runs end to end (its figures are not asserted beyond sanity)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.integration
def test_packing_benchmark_quick_run_writes_its_figures(tmp_path: Path) -> None:
    output = tmp_path / "packing.json"
    completed = subprocess.run(
        [sys.executable, "-m", "tools.bench.packing", "--quick", "--json", str(output)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    figures = json.loads(output.read_text())
    padding = {row["scheme"]: row["padded_fraction"] for row in figures["padding"]}
    assert padding["packed rows"] == 0.0
    assert padding["packed rows as a fixed-shape grid"] < padding["padded to longest, whole batch"]
    assert all(row["tokens_per_second"] > 0 for row in figures["speed"])
    assert "tokens/s" in completed.stdout
