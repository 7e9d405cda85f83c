"""The LoRA sync benchmark runs end to end, and the adapter of a 7B-shaped model is the 20x-smaller push it claims."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.integration
def test_lora_benchmark_quick_run_writes_its_figures(tmp_path: Path) -> None:
    output = tmp_path / "lora.json"
    completed = subprocess.run(
        [sys.executable, "-m", "tools.bench.lora", "--quick", "--json", str(output)],
        capture_output=True, text=True, timeout=240, check=False,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    figures = json.loads(output.read_text())
    fewer = {(row["model"], row["rank"]): row["fewer"] for row in figures["bytes"]}
    assert fewer[("Qwen2.5-7B", 16)] >= 20 and fewer[("Llama-3.1-8B", 16)] >= 20
    full, adapter = figures["sync"]
    assert full["update"] == "full weights" and adapter["update"].startswith("LoRA adapter")
    assert 0 < adapter["megabytes"] < full["megabytes"]  # what actually travelled, as the sender counted it
    sglang_full, sglang_adapter = figures["sglang"]  # the same pushes into an SGLang-compatible server
    assert sglang_full["megabytes"] == pytest.approx(full["megabytes"], rel=0.01)
    assert sglang_adapter["megabytes"] == pytest.approx(adapter["megabytes"])
    assert sglang_full["seconds"] > 0 and sglang_adapter["seconds"] > 0
    assert "fewer bytes" in completed.stdout and "weights loaded" not in completed.stdout + completed.stderr
