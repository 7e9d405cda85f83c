"""A real pretrained model through launcher.py: SmolLM2-135M-Instruct, its 49,152-token BPE vocabulary and chat
template, fully-async GRPO on a LoRA adapter with eval rounds, as the demo runs it, sized for CI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tools.make_arithmetic_data import make_sum_questions

pytestmark = pytest.mark.system
REPO = Path(__file__).resolve().parents[2]
STEPS = 2
RUN_TIMEOUT_S = 400


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_smollm2_trains_through_the_launcher_with_eval_rounds_on_the_versions_it_pushed(
        smollm2_path: Path, tmp_path: Path) -> None:
    data = make_sum_questions(tmp_path / "data", eval_size=8)
    run_dir = tmp_path / "run"
    command = [sys.executable, str(REPO / "launcher.py"), "--head", "--run-dir", str(run_dir),
               "--hf-checkpoint", str(smollm2_path), "--prompt-data", str(data["train"]),
               "--eval-prompt-data", "heldout", str(data["eval"]), "--eval-interval", "1000",
               "--apply-chat-template", "--rm-type", "final_number", "--rollout-max-response-len", "12",
               "--advantage-estimator", "grpo", "--n-samples-per-prompt", "4", "--rollout-batch-size", "2",
               "--num-rollout", str(STEPS), "--lora-rank", "8", "--lora-alpha", "16", "--lr", "3e-4",
               "--max-staleness", "1", "--off-policy-correction", "tis", "--rollout-temperature", "1.0",
               "--rollout-workers", "1", "--reward-workers", "1", "--torch-threads", "1", "--no-progress",
               "--no-use-tensorboard", "--no-plots"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # The terminal keeps to warnings (--console-log-level's default): each actor's start and exit is in the logs only.
    assert "actor process started" not in done.stderr and "actor exited" not in done.stderr
    assert "actor process started" in (run_dir / "logs" / "launcher-0.jsonl").read_text()

    steps = _rows(run_dir / "metrics" / "train.jsonl")
    assert [row["step"] for row in steps] == list(range(1, STEPS + 1))
    for row in steps:  # the reward's parts, logged apart; responses measured in BPE tokens
        assert {"reward/correct", "reward/format_ok", "reward/truncated"} <= row.keys()
        assert 0 < row["rollout/response_length_mean"] <= 12
    rounds = _rows(run_dir / "metrics" / "eval.jsonl")
    assert [row["step"] for row in rounds] == [0, STEPS]  # before training, and the final version's round
    for row in rounds:  # every eval sample came from the weights of the version it evaluates: the adapter arrived
        assert row["eval/heldout/failed_samples"] == 0 and row["eval/heldout/off_version_samples"] == 0
        assert "eval/heldout/reward/format_ok" in row
    # the final round's gain since the baseline, paired over the 8 held-out prompts from their scores per prompt
    scores = _rows(run_dir / "metrics" / "eval_scores.jsonl")
    assert [(row["step"], row["set"], len(row["scores"])) for row in scores] == [(0, "heldout", 8),
                                                                                  (STEPS, "heldout", 8)]
    final, (first, last) = rounds[-1], (row["scores"] for row in scores)
    assert final["eval/heldout/gain_prompts"] == 8 and final["eval/heldout/gain_since"] == 0
    assert final["eval/heldout/gain/reward/correct"] == pytest.approx(
        sum(last[key]["reward/correct"] - first[key]["reward/correct"] for key in first) / 8)
    assert "eval/heldout/gain_se/mean_reward" in final

    # The exported model is the base with the adapter merged, an ordinary HF folder, and the adapter beside it.
    exported = load_file(str(run_dir / "final_model" / "model.safetensors"))
    assert {name: tensor.shape for name, tensor in exported.items()} == {
        name: tensor.shape for name, tensor in load_file(str(smollm2_path / "model.safetensors")).items()}
    adapter = load_file(str(run_dir / "final_model" / "adapter" / "adapter_model.safetensors"))
    assert any(".lora_B." in name for name in adapter)
    assert (run_dir / "final_model" / "chat_template.jinja").is_file()
