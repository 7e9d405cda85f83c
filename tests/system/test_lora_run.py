"""A LoRA run through launcher.py: adapter-sized pushes, a merged export with its adapter, and an exact resume.

Exactness is checked the way a fully-async run allows (tests/system/test_reproducible_runs.py): the run records
its batches; a replay trains the first half, stops, and a resumed run trains the second half from the
checkpoint. Its losses and its final model must be the recorded run's, bit for bit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tools.make_arithmetic_data import make_arithmetic_data

REPO = Path(__file__).resolve().parents[2]
COMMON = ["--rollout-batch-size", "4", "--n-samples-per-prompt", "1", "--rollout-max-response-len", "4",
          "--loss-type", "sft", "--lr", "1e-2", "--lora-rank", "4", "--lora-alpha", "8", "--target-modules",
          "q_proj", "v_proj", "down_proj", "--max-staleness", "2", "--torch-threads", "1",
          "--final-eval-timeout", "0", "--no-progress", "--no-use-tensorboard", "--no-plots"]


def _launch(run_dir: Path, *arguments: str) -> None:
    command = [sys.executable, str(REPO / "launcher.py"), "--head", "--run-dir", str(run_dir), *COMMON, *arguments]
    finished = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=150)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]


def _losses(run_dir: Path) -> list[tuple[int, float, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics" / "train.jsonl").read_text().splitlines()]
    return [(row["batch_id"], row["loss"], row["grad_norm"]) for row in rows]


def _pushed_megabytes(run_dir: Path) -> list[float]:
    lines = (run_dir / "logs" / "learner.jsonl").read_text().splitlines()
    return [record["mb"] for record in map(json.loads, lines) if record.get("event") == "weights pushed"]


@pytest.mark.system
@pytest.mark.timeout(500)
def test_a_lora_run_pushes_its_adapter_exports_both_and_resumes_exactly(tmp_path: Path, tiny_model_path: Path) -> None:
    data = make_arithmetic_data(tmp_path / "data", max_operand=9, eval_size=10)["train"]
    model = ["--hf-checkpoint", str(tiny_model_path)]
    recorded, first_half, second_half = tmp_path / "async", tmp_path / "half", tmp_path / "resumed"
    _launch(recorded, *model, "--num-rollout", "4", "--prompt-data", str(data), "--rollout-workers", "2",
            "--save-debug-rollout-data", str(tmp_path / "batches"))
    replay = [*model, "--debug-train-only", "--load-debug-rollout-data", str(tmp_path / "batches"),
              "--rollout-workers", "0", "--reward-workers", "0"]
    _launch(first_half, *replay, "--num-rollout", "2")
    _launch(second_half, *replay, "--num-rollout", "4", "--load", str(first_half / "checkpoints"))

    full_megabytes = sum(tensor.numel() * 4 for tensor in load_file(str(tiny_model_path / "model.safetensors"))
                         .values()) / 1e6
    pushes = _pushed_megabytes(recorded)
    assert pushes and max(pushes) < full_megabytes / 5  # the adapter travelled, not the model

    adapter_config = json.loads((recorded / "final_model" / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["r"] == 4 and sorted(adapter_config["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    base = load_file(str(tiny_model_path / "model.safetensors"))
    merged = load_file(str(recorded / "final_model" / "model.safetensors"))
    changed = sorted(name for name, tensor in merged.items() if not bool((tensor == base[name]).all()))
    assert changed and all(name.endswith(("q_proj.weight", "v_proj.weight", "down_proj.weight")) for name in changed)

    assert len(_losses(recorded)) == 4
    assert _losses(first_half) == _losses(recorded)[:2]
    assert _losses(second_half) == _losses(recorded)[2:]  # resumed from the adapter checkpoint, bit for bit
    for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
        assert (second_half / "final_model" / name).read_bytes() == (recorded / "final_model" / name).read_bytes()
