"""`tools/bench/profile_train_step.py` on the CPU: both steps profiled, their tables printed and written."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.bench.profile_train_step import main


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_both_steps_are_profiled_and_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--quick", "--device", "cpu", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    for name in ("torch_trainer", "bare_HF"):
        table = (tmp_path / f"{name}.txt").read_text()
        assert table.startswith(f"## {name.replace('_', ' ')}: ") and "aten::mm" in table  # the matmuls were seen
        assert table.splitlines()[0] in printed
        assert (tmp_path / f"{name}.trace.json").stat().st_size > 0
