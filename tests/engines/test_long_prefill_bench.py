"""The long-prompt prefill benchmark still runs end to end (smoke only: its figures are shown by the benchmark, not
tested)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.console import PROGRESS_BAR, env_without_quiet_switches

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.integration
def test_bench_long_prefill_quick_run_prints_its_table_and_writes_its_figures(tmp_path: Path) -> None:
    figures_path = tmp_path / "bench.json"
    completed = subprocess.run(
        [sys.executable, "-m", "tools.bench.long_prefill", "--quick", "--threads", "1", "--model-cache",
         str(tmp_path / "models"), "--json", str(figures_path)],
        cwd=REPO, env=env_without_quiet_switches(), capture_output=True, text=True, timeout=240, check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert not PROGRESS_BAR.search(completed.stderr), completed.stderr[-3000:]
    lines = completed.stdout.splitlines()
    assert lines[0].startswith("model: quick") and "64 tokens per forward" in lines[0]
    assert lines[1].split()[:4] == ["prompt", "weights", "KV", "cache"]
    [row] = lines[3:]
    assert row.split()[:2] == ["1536", "tiny"] and "positions" in row  # past the tiny model's 1024: random weights
    figures = json.loads(figures_path.read_text())
    [measured] = figures["rows"]
    assert measured["prompt_tokens"] == 1536 and figures["chunk_tokens"] == 64
    assert measured["unchunked"]["forwards"] == 1 and measured["chunked"]["forwards"] == 1536 // 64
    for side in ("unchunked", "chunked"):
        assert set(measured[side]) == {"seconds", "peak_mib", "kv_mib", "forwards"}
