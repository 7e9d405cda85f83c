"""A full fully-async run with `--train-backend megatron` (megatron on the CPU via `engines.megatron.cpu_compat`):
it trains every batch, pushes weights and checkpoints like the torch backend, and runs slime's three Megatron hooks.
Two tensor-parallel ranks run the same loop in tests/system/test_multinode_learner.py (a rank on each node, the same
assertions), and two local ranks started by the learner actor in the expert-parallel runs of
test_routing_replay_run.py and test_slime_script_run.py."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.make_arithmetic_data import make_arithmetic_data

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

REPO = Path(__file__).resolve().parents[2]
STEPS = 4


@pytest.mark.system
@pytest.mark.timeout(400)
def test_megatron_backend_runs_the_whole_loop(tmp_path: Path, tiny_model_path: Path) -> None:
    data = make_arithmetic_data(tmp_path / "data", max_operand=9, eval_size=10)["train"]
    run_dir = tmp_path / "run"
    command = [sys.executable, str(REPO / "launcher.py"), "--head", "--run-dir", str(run_dir),
               "--hf-checkpoint", str(tiny_model_path), "--prompt-data", str(data), "--num-rollout", str(STEPS),
               "--train-backend", "megatron", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
               "--rollout-max-response-len", "4", "--max-staleness", "1", "--save-interval", "2", "--lr", "1e-4",
               "--rollout-workers", "1", "--reward-workers", "1", "--no-progress", "--no-use-tensorboard",
               "--no-plots"]  # fmt: skip
    trace = tmp_path / "hooks.jsonl"
    command += [  # slime's three Megatron hooks, loaded by their slime flags, in a real run
        "--custom-megatron-init-path", "examples.slime_style.megatron_hooks.init",
        "--custom-megatron-before-log-prob-hook-path", "examples.slime_style.megatron_hooks.before_log_prob",
        "--custom-megatron-before-train-step-hook-path", "examples.slime_style.megatron_hooks.before_train_step"]
    environment = {**os.environ, "MEGATRON_HOOK_TRACE": str(trace)}
    finished = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=360, env=environment)
    assert finished.returncode == 0, (finished.stdout + finished.stderr)[-4000:]
    lines = (run_dir / "metrics" / "train.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    assert max(record["step"] for record in records) == STEPS
    assert all(math.isfinite(record["loss"]) for record in records)
    assert any((run_dir / "checkpoints").rglob("trainer_state.json")), "no Megatron checkpoint was written"
    pushed = [json.loads(line) for line in (run_dir / "logs" / "learner.jsonl").read_text().splitlines()
              if '"weights pushed"' in line]
    assert max(record["version"] for record in pushed) == STEPS, "the engines never received the final weights"
    calls = [json.loads(line) for line in trace.read_text().splitlines()]
    assert calls[0]["hook"] == "init" and sum(call["hook"] == "init" for call in calls) == 1
    steps = [(call["rollout_id"], call["step_id"]) for call in calls if call["hook"] == "train_step"]
    assert steps == [(batch, 0) for batch in range(STEPS)]
    assert all(math.isfinite(call["param_norm"]) for call in calls if call["hook"] == "train_step")
    assert {call["store_prefix"] for call in calls if call["hook"] == "log_prob"} <= {"", "ref_"}
