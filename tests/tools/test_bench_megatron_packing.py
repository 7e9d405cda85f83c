"""`tools/bench/megatron_packing.py`: both layouts train on the same batch, the table's ratios are to the padded
baseline, and the console carries the table, not megatron's warnings."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.support.console import env_without_quiet_switches
from tools.bench.megatron_packing import QUICK, make_samples, summarise
from tools.gpu.check import megatron_step_command, megatron_step_row

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")


@pytest.mark.unit
def test_rows_divide_the_baselines_median_and_count_padding_from_the_real_plans() -> None:
    samples = make_samples(QUICK, seed=0)
    rows = {row.layout: row for row in summarise(samples, QUICK.budget, {"thd": [2.0, 1.0, 3.0], "bshd": [4.0]})}
    assert rows["thd"].seconds == 2.0 and rows["thd"].speedup == 2.0 and rows["bshd"].speedup == 1.0
    tokens = sum(int(s.tokens.numel()) for s in samples)
    assert rows["thd"].tokens_per_second == tokens / 2.0
    assert rows["thd"].padded_fraction == 0.0 < rows["bshd"].padded_fraction
    assert rows["thd"].micro_batches <= rows["bshd"].micro_batches


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_a_quick_run_prints_one_quiet_table_and_writes_its_rows(tmp_path: Path) -> None:
    """Run as `python -m tools.gpu.check --quick` runs it for its megatron-step row, which is made here from the
    rows the run wrote (tests/system/test_gpu_check.py skips the row rather than run the benchmark again)."""
    output = tmp_path / "rows.json"
    completed = subprocess.run(
        megatron_step_command(output, quick=True),
        capture_output=True, text=True, timeout=170, check=False, env=env_without_quiet_switches(),
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    rows = json.loads(output.read_text())["rows"]
    assert [row["layout"] for row in rows] == ["thd", "bshd"]
    assert all(row["seconds"] > 0 for row in rows)
    assert "packed (thd)" in completed.stdout and "padded (bshd), baseline" in completed.stdout
    assert "Warning" not in completed.stderr and "RNG" not in completed.stderr, completed.stderr[-2000:]
    megatron_step = megatron_step_row(output)
    assert megatron_step.status == "ok" and "of padded slots were padding" in megatron_step.result, megatron_step
