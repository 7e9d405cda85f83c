"""Two policies co-trained in one launcher.py run on one shared torch engine: each a LoRA adapter served by name.

Each policy has its own data, learning rate, buffer and learner (and its own run directory under
RUN_DIR/policies/), and both generate on the same engine. What shows that the engine served each policy its own
adapter: the runs are on-policy (--max-staleness 0), so the learner recomputes its samples' log-probs at the very
version that generated them, and the difference from the engine's log-probs stays at float noise for both
policies, although their adapters have moved apart (a row generated with the other policy's adapter, or with none,
would differ by far more once they have). Each policy's batches hold only its own prompts, and its late samples
come from an adapter it pushed. The run's certificate holds each policy's: its pushes fingerprinted as served.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from bus.codec import decode
from policies.plugins import load_object
from policies.rewards import RewardInput
from tools.make_arithmetic_data import make_arithmetic_data, make_sum_questions

REPO = Path(__file__).resolve().parents[2]
STEPS = 3
POLICIES = ("add", "sums")
# Rewards that vary between an untrained model's samples (so each policy's adapter gets a gradient), one per policy.
REWARDS = {"add": "tests.support.reward_plugins:digit_share", "sums": "tests.support.reward_plugins:letter_share"}


def prompts_of(path: Path) -> set[str]:
    return {json.loads(line)["input"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()}


@pytest.mark.system
@pytest.mark.timeout(300)
def test_two_policies_train_their_own_adapters_on_one_shared_engine(tmp_path: Path, tiny_model_path: Path) -> None:
    data = {"add": make_arithmetic_data(tmp_path / "add", max_operand=9, eval_size=10)["train"],
            "sums": make_sum_questions(tmp_path / "sums", eval_size=10)["train"]}
    run_dir = tmp_path / "run"
    settings = {"policies": {
        "add": {"prompt_data": str(data["add"]), "lr": 2e-2, "custom_rm_path": REWARDS["add"],
                "save_debug_rollout_data": str(tmp_path / "batches-add")},
        "sums": {"prompt_data": str(data["sums"]), "lr": 1e-2, "custom_rm_path": REWARDS["sums"],
                 "save_debug_rollout_data": str(tmp_path / "batches-sums")},
    }}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(settings, sort_keys=False), encoding="utf-8")
    command = [
        sys.executable, str(REPO / "launcher.py"), "--head", "--run-dir", str(run_dir),
        "--config", str(tmp_path / "run.yaml"), "--hf-checkpoint", str(tiny_model_path),
        "--num-rollout", str(STEPS), "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
        "--rollout-max-response-len", "8", "--max-staleness", "0", "--rollout-workers", "1", "--reward-workers", "1",
        "--lora-rank", "4", "--lora-alpha", "8", "--target-modules", "q_proj", "v_proj",
        "--final-eval-timeout", "0", "--heartbeat-interval", "0.25",
        "--no-progress", "--no-use-tensorboard", "--no-plots",
    ]  # fmt: skip
    finished = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]

    for policy in POLICIES:
        rows = [json.loads(line) for line in
                (run_dir / "policies" / policy / "metrics" / "train.jsonl").read_text().splitlines()]
        assert [row["step"] for row in rows] == list(range(1, STEPS + 1)), policy
        assert max(row["train_rollout_logprob_abs_diff"] for row in rows) < 1e-4, (
            f"{policy}: the engine's log-probs are not its adapter's")

        last = decode((tmp_path / f"batches-{policy}" / f"batch_{STEPS:06d}.msgpack").read_bytes())
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
