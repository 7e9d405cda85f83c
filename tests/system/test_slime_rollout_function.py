"""Short real runs driven by a slime-style whole-rollout function over the SGLang-compatible CPU server: one of the
user's (--rollout-function-path), which leases, over-samples and puts a group back, generates, and scores its own
samples, slime's samples -> train-data conversion (--custom-convert-samples-to-train-data-path) shaping the training
data, and slime's eval function (--eval-function-path) making each eval round through the same server; and our
client of slime's rollout-buffer service (--rollout-buffer-url), the stand-in service generating through the
server's /v1/chat/completions and scoring."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import requests

from actors.slime_compat.sample import from_wire
from bus.codec import decode
from examples.slime_style.rollout_function import rule_reward
from tools.make_arithmetic_data import make_arithmetic_data

REPO = Path(__file__).resolve().parents[2]
STEPS = 2
GROUPS = 2  # --rollout-batch-size
EVAL_PROMPTS = 10


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
    sets = make_arithmetic_data(tmp_path / "data", max_operand=9, eval_size=EVAL_PROMPTS)
    run_dir, debug_dir = tmp_path / "run", tmp_path / "batches"
    command = [
        sys.executable, str(REPO / "launcher.py"), "--head", "--run-dir", str(run_dir),
        "--hf-checkpoint", str(tiny_model_path), "--prompt-data", str(sets["train"]), "--num-rollout", str(STEPS),
        "--rollout-batch-size", str(GROUPS), "--n-samples-per-prompt", "2", "--rollout-max-batch-size", "4",
        # The function takes one group more than it returns: the staleness bound must leave room for it.
        "--max-staleness", "1", "--rollout-workers", "1", "--reward-workers", "1",
        "--rollout-engine", "sglang", "--sglang-server-module", "tools.standins.sglang_server",
        "--rollout-function-path", "examples.slime_style.rollout_function.generate_rollout",
        "--custom-convert-samples-to-train-data-path", "examples.slime_style.train_data.skip_truncated",
        "--rollout-max-response-len", "16", "--save-debug-rollout-data", str(debug_dir),
        # Each eval round (before training and of the final version) is one call of the function on the worker
        # pinned at that version; it reads --eval-prompt-data itself and generates through the server in its args.
        "--eval-function-path", "tests.support.slime_eval_function:over_the_server", "--eval-interval", str(STEPS),
        "--eval-prompt-data", "arith", str(sets["eval"]), "--eval-max-response-len", "4",
        "--final-eval-timeout", "60", "--heartbeat-interval", "0.25", "--weight-transfer-timeout", "20",
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

    # The eval function ran once per round, called with the round's version, and the server it was pointed at
    # answered with those weights (the final version's pushed ones); every prompt's result came back per dataset,
    # with the function's rewards (the reward worker kept them).
    # The final version is the last row's: a step that trains no token (all its responses truncated: the sampling
    # is not seeded) makes none, so it is 1 or 2, or 0 in a run whose two steps both trained nothing.
    rounds = [json.loads(line) for line in (run_dir / "metrics" / "eval.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rounds] == sorted({0, rows[-1]["version"]}), rounds
    for row in rounds:
        assert row["eval/rollout_id"] == row["eval/served_weight_version"] == row["step"], row
        assert row["eval/arith/samples"] == EVAL_PROMPTS and 0 <= row["eval/arith/truncated_ratio"] <= 1, row
        assert row["eval/arith/mean_reward"] == pytest.approx(row["eval/arith/function_mean_reward"]), row
        assert row["eval/arith/mean_reward"] > 0, row


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _serving(url: str, service: subprocess.Popen, timeout: float) -> None:
    """Wait until the stand-in service answers, or fail saying why."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and service.poll() is None:
        try:
            requests.post(f"{url}/get_rollout_data", json={}, timeout=2)
            return
        except requests.ConnectionError:
            time.sleep(0.1)
    raise AssertionError(f"the stand-in rollout-buffer service did not answer at {url} within {timeout}s "
                         f"(exit code {service.poll()})")


@pytest.mark.system
@pytest.mark.timeout(150)
def test_slimes_rollout_buffer_service_generates_through_our_engine_and_its_groups_train(
        tmp_path: Path, tiny_model_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "label": str(a + b)}) + "\n"
                               for a in range(4) for b in range(3)))
    url = f"http://127.0.0.1:{_free_port()}"
    service = subprocess.Popen([sys.executable, "-m", "tools.standins.rollout_buffer_service", "--port",
                                url.rsplit(":", 1)[1]], cwd=REPO)
    try:
        _serving(url, service, timeout=30)
        run_dir, debug_dir = tmp_path / "run", tmp_path / "batches"
        command = [
            sys.executable, str(REPO / "launcher.py"), "--head", "--run-dir", str(run_dir),
            "--hf-checkpoint", str(tiny_model_path), "--prompt-data", str(prompts), "--input-key", "prompt",
            "--num-rollout", str(STEPS), "--rollout-batch-size", str(GROUPS), "--n-samples-per-prompt", "2",
            "--max-staleness", "1", "--rollout-workers", "1", "--reward-workers", "1",
            "--rollout-engine", "sglang", "--sglang-server-module", "tools.standins.sglang_server",
            "--rollout-buffer-url", url, "--rollout-task-type", "math", "--rollout-buffer-timeout", "90",
            "--off-policy-correction", "none", "--rollout-max-response-len", "16",
            "--save-debug-rollout-data", str(debug_dir), "--final-eval-timeout", "0", "--heartbeat-interval",
            "0.25", "--weight-transfer-timeout", "20", "--no-progress", "--no-use-tensorboard", "--no-plots",
        ]
        finished = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=140)
    finally:
        service.terminate()
        service.wait(10)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]

    batches = [decode(path.read_bytes()).samples for path in sorted(debug_dir.glob("batch_*.msgpack"))]
    assert len(batches) == STEPS
    for samples in batches:
        assert len(samples) == GROUPS * 2
        for sample in samples:
            # The service's conversation, tokenised through the chat template; its own reward, not scored again.
            assert isinstance(sample.prompt, list) and sample.prompt[-1]["content"].endswith("=")
            assert sample.response_length > 0 and sample.loss_mask is not None and sample.loss_mask.all()
            assert sample.rollout_log_probs is None
            assert sample.reward == float(sample.label in sample.response.removesuffix("<|im_end|>\n"))
            assert {"instance_id", "uid", "timestamp"} <= set(sample.metadata)
        by_group: dict[str, set[int]] = {}
        for sample in samples:
            by_group.setdefault(sample.group_id, set()).add(sample.metadata["instance_id"])
        assert all(len(ids) == 1 for ids in by_group.values())  # one of the service's groups per slot
    rollout, reward = _counters(run_dir, "rollout-"), _counters(run_dir, "reward-")
    assert rollout.get("rollout_fn.failed", 0) == 0 and rollout.get("rollout_fn.groups_invalid", 0) == 0
    assert reward["samples.prescored"] >= STEPS * GROUPS * 2
