"""tools/bench/bus_speed.py --quick runs end to end and writes its figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.integration
def test_bench_bus_quick_writes_every_row(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "tools.bench.bus_speed", "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(out.read_text())
    rows = {(r["payload"], r["transport"], r["system"]) for r in figures["stream"]}
    expected = {(p, t, s) for p in ("1KB", "100KB", "4MB") for t in ("tcp", "ipc") for s in ("bus", "raw")}
    assert expected <= rows
    assert all(r["msgs_per_s"] > 0 and r["p99_us"] >= r["p50_us"] > 0 for r in figures["stream"])
    assert {r["payload"] for r in figures["codec"]} == {"1KB", "100KB", "4MB"}
    assert "msgs/s" in result.stdout and "target bus_vs_raw_100KB_tcp" in result.stdout
