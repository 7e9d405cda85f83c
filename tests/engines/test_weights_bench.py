"""The weight-transfer benchmark still runs end to end (its figures are not asserted beyond sanity)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.integration
def test_weight_transfer_benchmark_quick_run_writes_its_figures(tmp_path: Path) -> None:
    output = tmp_path / "weights.json"
    completed = subprocess.run(
        [
            sys.executable,
            "-m", "tools.bench.weights",
            "--quick",
            "--receivers",
            "1",
            "--json",
            str(output),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    rows = json.loads(output.read_text())["rows"]
    assert {(row["transport"], row["dtype"], row["receivers"]) for row in rows} == {
        (transport, dtype, 1) for transport in ("gloo", "shm") for dtype in ("fp32", "bf16", "fp32>bf16")
    }
    assert all(row["raw_gbps"] > 0 and row["transfer_gbps"] > 0 for row in rows)
    assert "ours/raw" in completed.stdout


@pytest.mark.integration
def test_push_memory_benchmark_quick_run_writes_its_figures(tmp_path: Path) -> None:
    output = tmp_path / "push_memory.json"
    completed = subprocess.run(
        [sys.executable, "-m", "tools.bench.push_memory", "--quick", "--json", str(output)],
        capture_output=True, text=True, timeout=180, check=False,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    figures = json.loads(output.read_text())
    rows = {row["mode"]: row for row in figures["rows"]}
    assert set(rows) == {"listed", "streamed"}
    # Listed, every gathered tensor is alive at the end of the listing: the whole model.
    assert rows["listed"]["held_mb"] == pytest.approx(rows["listed"]["model_mb"], rel=1e-3)
    assert rows["streamed"]["held_mb"] <= rows["listed"]["held_mb"]
    assert all(row["seconds"] > 0 for row in rows.values()) and "vs listed" in completed.stdout


@pytest.mark.integration
def test_fingerprint_benchmark_quick_run_checks_every_push_it_times(tmp_path: Path) -> None:
    output = tmp_path / "fingerprint.json"
    completed = subprocess.run(
        [sys.executable, "-m", "tools.bench.fingerprint", "--quick", "--json", str(output)],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    figures = json.loads(output.read_text())
    (row,) = figures["pushes"]
    assert row["model"] == "tiny" and min(row["unchecked_s"], row["checked_s"], row["full_s"], row["engine_s"]) > 0
    assert {speed["algorithm"] for speed in figures["speeds"]} == {"xxh3", "wsum"}
    assert "--weight-check" in completed.stdout
