"""Two policies co-trained in one launcher.py run on one shared torch engine: each a LoRA adapter served by name.

The run is examples/policies/two_tasks.yaml on this test's data: each policy has its own data, reward, loss,
buffer and learner (and its own run directory under RUN_DIR/policies/), and both generate on the same engine.
What shows that the engine served each policy its own adapter: the runs are on-policy (--max-staleness 0), so the
learner recomputes its samples' log-probs at the very version that generated them, and the difference from the
engine's log-probs stays at float noise for both policies, although their adapters have moved apart (a row
generated with the other policy's adapter, or with none, would differ by far more once they have). Each policy's
batches hold only its own prompts, scored by its own reward, and its late samples come from an adapter it pushed.
The run's certificate holds each policy's: its pushes fingerprinted as served.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from actors.runtime.metrics import read_metrics
from bus.codec import decode
from policies.plugins import load_object
from policies.rewards import RewardInput
from tests.system.test_fault_tolerance import current_pid
from tools.audit_run import audit
from tools.make_arithmetic_data import make_arithmetic_data, make_sum_questions

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "policies" / "two_tasks.yaml"
STEPS = 3
POLICIES = ("add", "sums")
# Rewards that vary between an untrained model's samples (so each policy's adapter gets a gradient), one per policy.
REWARDS = {"add": "tests.support.reward_plugins:digit_share", "sums": "tests.support.reward_plugins:letter_share"}


def prompts_of(path: Path) -> set[str]:
    return {json.loads(line)["input"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()}


def two_policy_run(tmp_path: Path, model: Path, steps: int, **per_policy: object) -> tuple[list[str], dict[str, Path]]:
    """The launcher command of examples/policies/two_tasks.yaml on this test's data and rewards, `per_policy`
    settings on top of each policy's; and each policy's data."""
    data = {"add": make_arithmetic_data(tmp_path / "add", max_operand=9, eval_size=10)["train"],
            "sums": make_sum_questions(tmp_path / "sums", eval_size=10)["train"]}
    settings = yaml.safe_load(EXAMPLE.read_text(encoding="utf-8"))
    for policy in POLICIES:
        settings["policies"][policy].update(prompt_data=str(data[policy]), custom_rm_path=REWARDS[policy],
                                            save_debug_rollout_data=str(tmp_path / f"{policy}-batches"), lr=2e-2,
                                            **per_policy)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(settings, sort_keys=False), encoding="utf-8")
    return [
        sys.executable, str(REPO / "launcher.py"), "--head", "--run-dir", str(tmp_path / "run"),
        "--config", str(tmp_path / "run.yaml"), "--hf-checkpoint", str(model),
        "--num-rollout", str(steps), "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
        "--rollout-max-response-len", "8", "--rollout-workers", "1", "--reward-workers", "1",
        "--final-eval-timeout", "0", "--heartbeat-interval", "0.25", "--restart-backoff", "0.2",
        "--no-progress", "--no-use-tensorboard", "--no-plots",
    ], data  # fmt: skip


def trained(run_dir: Path, policy: str) -> list[dict]:
    path = run_dir / "policies" / policy / "metrics" / "train.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")] if (
        path.exists()) else []


@pytest.mark.system
@pytest.mark.timeout(300)
def test_two_policies_train_their_own_adapters_on_one_shared_engine(tmp_path: Path, tiny_model_path: Path) -> None:
    command, data = two_policy_run(tmp_path, tiny_model_path, STEPS, max_staleness=0)
    run_dir = tmp_path / "run"
    finished = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]

    for policy in POLICIES:
        rows = trained(run_dir, policy)
        assert [row["step"] for row in rows] == list(range(1, STEPS + 1)), policy
        assert max(row["train_rollout_logprob_abs_diff"] for row in rows) < 1e-4, (
            f"{policy}: the engine's log-probs are not its adapter's")

        last = decode((tmp_path / f"{policy}-batches" / f"batch_{STEPS:06d}.msgpack").read_bytes())
        assert {sample.prompt for sample in last.samples} <= prompts_of(data[policy]), f"{policy}: others' prompts"
        reward = load_object(REWARDS[policy], what="reward")
        scores = [reward(RewardInput(prompt="", response=sample.response)) for sample in last.samples]
        assert [sample.reward for sample in last.samples] == pytest.approx(scores), f"{policy}: another's reward"
        versions = [int(sample.token_versions.min()) for sample in last.samples if sample.response_length]
        assert versions and min(versions) == STEPS - 1, f"{policy}: late samples not from its own pushed adapter"

    certificate = json.loads((run_dir / "integrity.json").read_text())
    assert certificate["ok"] and set(certificate["policies"]) == set(POLICIES), certificate  # pushes served as sent

    adapters = [load_file(str(run_dir / "policies" / policy / "final_model" / "adapter" / "adapter_model.safetensors"))
                for policy in POLICIES]
    assert adapters[0].keys() == adapters[1].keys()
    assert any(not bool((adapters[0][name] == adapters[1][name]).all()) for name in adapters[0])


@pytest.mark.system
@pytest.mark.timeout(300)
def test_a_policys_learner_killed_mid_run_resumes_while_the_other_trains_on(tmp_path: Path,
                                                                           tiny_model_path: Path) -> None:
    """kill -9 of one policy's learner: the launcher restarts it from its checkpoint, the other policy's learner
    is never touched, and each policy's audit finds every accepted sample trained once."""
    steps = 6
    command, _ = two_policy_run(tmp_path, tiny_model_path, steps, max_staleness=1, save_interval=2)
    run_dir = tmp_path / "run"
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "policies" / "add" / "checkpoints" / "step_000002").is_dir():
            assert process.poll() is None and time.monotonic() < deadline, "add never saved step 2"
            time.sleep(0.1)
        os.kill(current_pid(run_dir, "learner@add"), signal.SIGKILL)
        output, _ = process.communicate(timeout=240)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output[-4000:]

    launcher_log = (run_dir / "logs" / "launcher-0.jsonl").read_text()
    assert '"actor": "learner@add", "code": -9' in launcher_log
    starts = [record["actor"] for record in read_metrics(run_dir / "logs" / "launcher-0.jsonl")
              if record.get("event") == "actor process started"]
    assert starts.count("learner@add") == 2 and starts.count("learner@sums") == 1, starts
    resumed = [record["trained_batch"] for record in read_metrics(run_dir / "policies" / "add" / "logs" /
                                                                   "learner@add.jsonl")
               if record.get("event") == "resumed from checkpoint"]
    assert resumed and resumed[0] >= 2, resumed
    sums_steps = [row["step"] for row in trained(run_dir, "sums")]
    assert sums_steps == list(range(1, steps + 1)), sums_steps  # no step of the other policy lost or repeated
    for policy in POLICIES:
        report = audit(run_dir / "policies" / policy)
        assert report.ok and report.trained_batches == steps, (policy, report.problems)
