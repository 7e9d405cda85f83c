"""Runs through launcher.py with the torch engine on its static KV pool (`--torch-kv-cache static`), the layout
every torch engine takes on a GPU: rows joining and leaving while weights arrive, and colocated turns that give the
pool back between steps. Here it steps eagerly (no CUDA graphs on a CPU); the graphs are `tests/engines/
test_static_batcher_gpu.py`'s."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.make_arithmetic_data import make_arithmetic_data

REPO = Path(__file__).resolve().parents[2]
BATCHES = 4  # past --max-staleness 2: later batches are generated while newer weights arrive


@pytest.mark.system
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["fully-async", "colocate"])
def test_a_run_on_the_static_kv_pool_trains_every_batch(tmp_path: Path, tiny_model_path: Path, mode: str) -> None:
    data = make_arithmetic_data(tmp_path / "data", max_operand=9, eval_size=10)["train"]
    run_dir = tmp_path / "run"
    command = [sys.executable, str(REPO / "launcher.py"), "--head", "--run-dir", str(run_dir),
               "--hf-checkpoint", str(tiny_model_path), "--prompt-data", str(data), "--num-rollout", str(BATCHES),
               "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "8",
               "--rollout-max-batch-size", "6", "--rollout-workers", "2", "--reward-workers", "1", "--seed", "3",
               "--lr", "1e-3", "--torch-threads", "1", "--torch-kv-cache", "static", "--torch-kv-pool-columns", "64",
               "--final-eval-timeout", "0", "--no-progress", "--no-use-tensorboard", "--no-plots",
               *(["--colocate"] if mode == "colocate" else ["--max-staleness", "2"])]
    finished = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=280)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    assert "torch_kv_cache: static" in (run_dir / "config.yaml").read_text()
    rows = [json.loads(line) for line in (run_dir / "metrics" / "train.jsonl").read_text().splitlines()]
    assert [row["batch_id"] for row in rows] == list(range(1, BATCHES + 1))
    assert all(row["rollout/response_length_mean"] > 0 for row in rows)
