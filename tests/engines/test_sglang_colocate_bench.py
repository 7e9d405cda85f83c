"""The colocated SGLang push benchmark runs end to end: both paths load into a real compatible server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.integration
def test_both_pushes_reach_the_server_and_the_table_compares_them(tmp_path: Path) -> None:
    output = tmp_path / "sglang-colocate.json"
    completed = subprocess.run([sys.executable, "-m", "tools.bench.sglang_colocate", "--quick",
                                "--dtypes", "bf16", "--json", str(output)],
                               capture_output=True, text=True, timeout=240, check=False, cwd=ROOT)
    assert completed.returncode == 0, completed.stderr[-2000:]
    (row,) = json.loads(output.read_text())["rows"]
    assert row["dtype"] == "bf16" and row["megabytes"] > 0
    assert row["broadcast_seconds"] > 0 and row["reference_seconds"] > 0
    assert "ref/broadcast" in completed.stdout
