"""A colocated run through launcher.py: on-policy turns, weights through shared memory, and an exact resume.

Colocated runs are on-policy by construction (the engines wait for each step's weights), so a run stopped after
two batches and relaunched in its run directory must train batches three and four exactly as a run that never
stopped: the same rewards, losses and gradient norms, bit for bit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engines.weights import shared_memory
from tools.make_arithmetic_data import make_arithmetic_data

REPO = Path(__file__).resolve().parents[2]


def _launch(run_dir: Path, model: Path, data: Path, batches: int) -> None:
    command = [sys.executable, str(REPO / "launcher.py"), "--head", "--run-dir", str(run_dir), "--colocate",
               "--hf-checkpoint", str(model), "--prompt-data", str(data), "--num-rollout", str(batches),
               "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "6",
               "--rollout-temperature", "1.0", "--rollout-workers", "2", "--reward-workers", "1", "--seed", "5",
               "--lr", "1e-3", "--torch-threads", "1", "--save-interval", "2", "--final-eval-timeout", "0",
               "--no-progress", "--no-use-tensorboard", "--no-plots"]
    finished = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=150)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics" / "train.jsonl").read_text().splitlines()]


def _training(rows: list[dict]) -> list[tuple[int, float, float, float]]:
    return [(row["batch_id"], row["rollout/reward_mean"], row["loss"], row["grad_norm"]) for row in rows]


@pytest.mark.system
@pytest.mark.timeout(500)
def test_a_colocated_run_takes_turns_and_resumes_exactly(tmp_path: Path, tiny_model_path: Path) -> None:
    data = make_arithmetic_data(tmp_path / "data", max_operand=9, eval_size=10)["train"]
    shm_before = set(shared_memory._directory().glob("slipstream-weights-*"))
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    _launch(whole, tiny_model_path, data, batches=4)
    _launch(resumed, tiny_model_path, data, batches=2)
    _launch(resumed, tiny_model_path, data, batches=4)  # the same run directory: it resumes

    config = (whole / "config.yaml").read_text()
    assert "weight_transport: shm" in config and "max_staleness: 0" in config
    rows = _rows(whole)
    assert len(rows) == 4
    assert all(row["staleness/max"] == 0 for row in rows)  # every sample from the weights of the step it trains
    assert _training(_rows(resumed)) == _training(rows)
    assert set(shared_memory._directory().glob("slipstream-weights-*")) == shm_before  # nothing left in /dev/shm
