"""A vision-language model through launcher.py: pictures named by the dataset (one of them broken), on the bus as
bytes, generated from by the torch engine, trained on by the torch learner with the vision tower frozen, with eval
rounds on held-out pictures: the VLM demo's run (tools/demo_vlm.py), sized for CI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tools.make_shape_data import make_shape_data

pytestmark = pytest.mark.system
REPO = Path(__file__).resolve().parents[2]
STEPS = 3
RUN_TIMEOUT_S = 300


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_vlm_trains_on_pictures_through_the_launcher_and_a_broken_picture_is_named_and_skipped(
        tiny_vlm_path: Path, tmp_path: Path) -> None:
    data = make_shape_data(tmp_path / "data", train_size=24, eval_size=4, sft_size=1)
    (tmp_path / "data" / "images" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n half a picture")
    with data["train"].open("a") as train:
        train.write(json.dumps({"input": "<image>How many shapes?", "images": ["images/broken.png"], "label": "1"})
                    + "\n")
    run_dir = tmp_path / "run"
    command = [sys.executable, str(REPO / "launcher.py"), "--head", "--run-dir", str(run_dir),
               "--hf-checkpoint", str(tiny_vlm_path), "--prompt-data", str(data["train"]),
               "--multimodal-keys", '{"image": "images"}', "--eval-prompt-data", "heldout", str(data["eval"]),
               "--eval-interval", "1000", "--custom-rm-path", "tests.support.reward_plugins:digit_share",
               "--rollout-max-response-len", "4",
               "--rollout-stop", "</s>", "--advantage-estimator", "grpo", "--n-samples-per-prompt", "4",
               "--rollout-batch-size", "4", "--num-rollout", str(STEPS), "--lr", "1e-3", "--max-staleness", "1",
               "--off-policy-correction", "tis", "--rollout-temperature", "1.0", "--rollout-workers", "1",
               "--reward-workers", "1", "--torch-threads", "1", "--no-progress", "--no-use-tensorboard", "--no-plots"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    warned = [row["event"] for row in _rows(run_dir / "logs" / "buffer.jsonl") if row.get("level") == "warning"]
    assert any(f"skipped 1 of 25 records of {data['train']} as malformed, the first at line 25: key 'images' image 0 "
               "(file" in event and "not a readable image" in event for event in warned), warned

    steps = _rows(run_dir / "metrics" / "train.jsonl")
    assert [row["step"] for row in steps] == list(range(1, STEPS + 1))
    assert all(row.get("dropped/bad_images", 0) == 0 for row in steps)
    rounds = _rows(run_dir / "metrics" / "eval.jsonl")
    assert [row["step"] for row in rounds] == [0, STEPS]
    for row in rounds:
        assert row["eval/heldout/failed_samples"] == 0 and row["eval/heldout/off_version_samples"] == 0
    assert json.loads((run_dir / "integrity.json").read_text())["ok"] is True

    # The language model trained (a reward that varies between an untrained model's samples gives it a gradient);
    # the vision tower, frozen, is the checkpoint's to the bit.
    before = load_file(str(tiny_vlm_path / "model.safetensors"))
    after = load_file(str(run_dir / "final_model" / "model.safetensors"))
    assert before.keys() == after.keys()
    tower = [name for name in before if ".visual." in name or name.startswith("visual.")]
    assert tower and all(torch.equal(before[name], after[name]) for name in tower)
    assert any(not torch.equal(before[name], after[name]) for name in before.keys() - set(tower))
