"""An agent written against the OpenAI client library drives a real run through launcher.py (#18): every sample is
one episode on the rollout worker's endpoint, and the learner trains on its model turns only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from bus.codec import decode
from examples.openai_agent import REVIEW
from tools.make_arithmetic_data import make_arithmetic_data

REPO = Path(__file__).resolve().parents[2]
STEPS = 2


@pytest.mark.system
@pytest.mark.timeout(150)
def test_an_openai_client_agent_runs_multi_turn_episodes_that_train(tiny_model_path: Path, tmp_path: Path) -> None:
    data = make_arithmetic_data(tmp_path / "data", max_operand=9, eval_size=4)["train"]
    run_dir, batches = tmp_path / "run", tmp_path / "batches"
    command = [
        sys.executable, str(REPO / "launcher.py"), "--head", "--run-dir", str(run_dir),
        "--hf-checkpoint", str(tiny_model_path), "--prompt-data", str(data), "--num-rollout", str(STEPS),
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "8",
        "--max-staleness", "1", "--agent-function-path", "examples.openai_agent:solve",
        "--custom-rm-path", "tests.support.reward_plugins:digit_share", "--save-debug-rollout-data", str(batches),
        "--final-eval-timeout", "0", "--heartbeat-interval", "0.25",
        "--no-progress", "--no-use-tensorboard", "--no-plots",
    ]
    finished = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=140)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]

    rows = [json.loads(line) for line in (run_dir / "metrics" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == STEPS and all(row["train/grad_norm"] > 0 for row in rows)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    for path in sorted(batches.glob("batch_*.msgpack")):
        for sample in decode(path.read_bytes()).samples:
            response = np.asarray(sample.tokens[sample.prompt_tokens:])
            mask = np.asarray(sample.loss_mask, dtype=bool)
            assert sample.metadata["turns"] >= 2, "the agent's follow-up turn is missing"
            masked_text = tokenizer.decode(response[~mask].tolist())
            assert f"<|im_start|>user\n{REVIEW}<|im_end|>" in masked_text
            assert REVIEW not in tokenizer.decode(response[mask].tolist())
            assert np.all(np.asarray(sample.rollout_log_probs)[mask] < 0)
