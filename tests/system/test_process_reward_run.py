"""Process supervision through launcher.py: a reward that grades every step of its responses, placed on their
tokens by the reward worker, carried by the samples through the buffer to a learner that credits each step
(`--advantage-estimator grpo_process`), across real processes and sockets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.make_arithmetic_data import make_arithmetic_data

REPO = Path(__file__).resolve().parents[2]
BATCHES = 2


@pytest.mark.system
@pytest.mark.timeout(300)
def test_steps_a_reward_grades_reach_the_learner_that_credits_them(tmp_path: Path, tiny_model_path: Path) -> None:
    data = make_arithmetic_data(tmp_path / "data", max_operand=9, eval_size=10)["train"]
    run_dir = tmp_path / "run"
    command = [sys.executable, str(REPO / "launcher.py"), "--head", "--run-dir", str(run_dir),
               "--hf-checkpoint", str(tiny_model_path), "--prompt-data", str(data), "--num-rollout", str(BATCHES),
               "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "8",
               "--custom-rm-path", "tests.support.reward_plugins:digits_graded_each",
               "--advantage-estimator", "grpo_process", "--step-discount", "0.5", "--rollout-workers", "1",
               "--reward-workers", "1", "--seed", "3", "--lr", "1e-3", "--torch-threads", "1",
               "--final-eval-timeout", "0", "--no-progress", "--no-use-tensorboard", "--no-plots"]
    finished = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=280)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics" / "train.jsonl").read_text().splitlines()]
    assert [row["batch_id"] for row in rows] == list(range(1, BATCHES + 1))
    for row in rows:  # a step per response character (a token each for the tiny tokenizer): the steps arrived
        assert row["rollout/graded_steps"] == pytest.approx(row["rollout/response_length_mean"], abs=1.0), row
        assert row["zero_advantage_skipped"] < 8
