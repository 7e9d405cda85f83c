"""A short real run driven by a slime-style whole-rollout function (--rollout-function-path) over the
SGLang-compatible CPU server: it leases, over-samples and puts a group back, generates, and scores its own samples;
slime's samples -> train-data conversion (--custom-convert-samples-to-train-data-path) shapes the training data."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from actors.slime_compat.sample import from_wire
from bus.codec import decode
from examples.slime_style.rollout_function import rule_reward
from tools.make_arithmetic_data import make_arithmetic_data

REPO = Path(__file__).resolve().parents[2]
STEPS = 2
GROUPS = 2  # --rollout-batch-size


def _counters(run_dir: Path, actor_prefix: str) -> dict[str, float]:
    """The counters an actor logged when it stopped."""
    for path in sorted((run_dir / "logs").glob(f"{actor_prefix}*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            if record.get("event") == "actor stopped":
                return record["counters"]
    raise AssertionError(f"no 'actor stopped' record for {actor_prefix} in {run_dir / 'logs'}")


@pytest.mark.system
@pytest.mark.timeout(150)
def test_slime_rollout_function_drives_a_training_run(tmp_path: Path, tiny_model_path: Path) -> None:
    data = make_arithmetic_data(tmp_path / "data", max_operand=9, eval_size=10)["train"]
    run_dir, debug_dir = tmp_path / "run", tmp_path / "batches"
    command = [
        sys.executable, str(REPO / "launcher.py"), "--head", "--run-dir", str(run_dir),
        "--hf-checkpoint", str(tiny_model_path), "--prompt-data", str(data), "--num-rollout", str(STEPS),
        "--rollout-batch-size", str(GROUPS), "--n-samples-per-prompt", "2", "--rollout-max-batch-size", "4",
        # The function takes one group more than it returns: the staleness bound must leave room for it.
        "--max-staleness", "1", "--rollout-workers", "1", "--reward-workers", "1",
        "--rollout-engine", "sglang", "--sglang-server-module", "tools.standins.sglang_server",
        "--rollout-function-path", "examples.slime_style.rollout_function.generate_rollout",
        "--custom-convert-samples-to-train-data-path", "examples.slime_style.train_data.skip_truncated",
        "--rollout-max-response-len", "16", "--save-debug-rollout-data", str(debug_dir),
        "--final-eval-timeout", "0", "--heartbeat-interval", "0.25", "--weight-transfer-timeout", "20",
        "--no-progress", "--no-use-tensorboard", "--no-plots",
        # loss_tokens below counts every trained token: keep the groups that scored alike in the step
        "--no-skip-zero-advantage-samples",
    ]
    finished = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=140)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]

    rows = [json.loads(line) for line in (run_dir / "metrics" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == STEPS
    batches = [decode(path.read_bytes()).samples for path in sorted(debug_dir.glob("batch_*.msgpack"))]
    assert len(batches) == STEPS
    for samples, row in zip(batches, rows, strict=True):
        assert len(samples) == GROUPS * 2
        # The conversion ran on each batch: it centres rewards per group (mean 0) and trains no truncated response.
        assert row["rollout/post_processed_reward_mean"] == pytest.approx(0.0, abs=1e-6)
        assert row["loss_tokens"] == sum(s.response_length for s in samples if s.status != "truncated")
        for sample in samples:
            # The function's own tokens and log-probs, and its rule's reward, kept by the reward worker.
            assert sample.response_length > 0 and len(sample.tokens) == sample.prompt_tokens + sample.response_length
            assert sample.rollout_log_probs is not None and np.all(sample.rollout_log_probs <= 0)
            assert sample.loss_mask is not None and sample.loss_mask.all()
            assert sample.reward == pytest.approx(rule_reward(from_wire(sample)))
            assert "_slipstream_group_id" not in sample.metadata

    rollout = _counters(run_dir, "rollout-")
    assert rollout.get("rollout_fn.failed", 0) == 0 and rollout.get("rollout_fn.groups_invalid", 0) == 0
    assert rollout["rollout_fn.calls"] >= STEPS
    reward = _counters(run_dir, "reward-")
    assert reward["samples.prescored"] >= STEPS * GROUPS * 2
    # The buffer names groups "epoch:position" in lease order. Call 0 leased 0:0-0:2, returned two and put 0:2
    # back; call 1 got 0:2 first and leased 0:3. A put-back group given up instead would wait out its lease.
    generated_by = [{(s.group_id, s.metadata["rollout_id"]) for s in samples} for samples in batches]
    assert generated_by == [{("0:0", 0), ("0:1", 0)}, {("0:2", 1), ("0:3", 1)}]
