"""A short real run with slime-style plugins: a search-augmented generate(args, sample, sampling_params) over the
SGLang-compatible CPU server and a batched group rm(args, samples), loaded by signature."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from actors.slime_compat.sample import from_wire
from bus.codec import decode
from examples.slime_style import group_rm
from examples.slime_style.search_generate import CORPUS, information
from tools.make_arithmetic_data import make_arithmetic_data

REPO = Path(__file__).resolve().parents[2]
STEPS = 2


def _run(tmp_path: Path, model: Path, *plugin_flags: str) -> Path:
    """A short real run over the SGLang-compatible CPU server with `plugin_flags`; returns its run directory."""
    data = make_arithmetic_data(tmp_path / "data", max_operand=9, eval_size=10)["train"]
    run_dir = tmp_path / "run"
    command = [
        sys.executable, str(REPO / "launcher.py"), "--head", "--run-dir", str(run_dir),
        "--hf-checkpoint", str(model), "--prompt-data", str(data), "--num-rollout", str(STEPS),
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-batch-size", "4",
        "--max-staleness", "0", "--rollout-workers", "1", "--reward-workers", "1",
        "--rollout-engine", "sglang", "--sglang-server-module", "engines.sglang.server",
        "--final-eval-timeout", "0", "--heartbeat-interval", "0.25", "--weight-transfer-timeout", "20",
        "--no-progress", "--no-use-tensorboard", "--no-plots", *plugin_flags,
    ]
    finished = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=140)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    return run_dir


@pytest.mark.system
@pytest.mark.timeout(150)
def test_slime_style_generate_and_group_rm_drive_a_training_run(tmp_path: Path, tiny_model_path: Path) -> None:
    debug_dir = tmp_path / "batches"
    _run(tmp_path, tiny_model_path, "--rollout-max-response-len", "96",
         "--custom-generate-function-path", "examples.slime_style.search_generate:generate",
         "--custom-rm-path", "examples.slime_style.group_rm:rm", "--group-rm",
         "--save-debug-rollout-data", str(debug_dir))

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    batches = sorted(debug_dir.glob("batch_*.msgpack"))
    assert len(batches) == STEPS
    for path in batches:
        samples = decode(path.read_bytes()).samples
        for sample in samples:
            response = sample.tokens[sample.prompt_tokens:]
            mask = np.asarray(sample.loss_mask)
            # The plugin's retrieved passage opens every response, untrained; the model's tokens follow, trained.
            question = sample.prompt if isinstance(sample.prompt, str) else sample.prompt[-1]["content"]
            block = len(tokenizer(information(question, CORPUS), add_special_tokens=False)["input_ids"])
            assert block < len(response)
            assert not mask[:block].any(), "retrieved passage was trained on"
            assert mask[block:].all(), "model tokens were masked"
            assert sample.rollout_log_probs is not None and np.all(sample.rollout_log_probs[block:] < 0)
        groups: dict[str, list] = {}
        for sample in samples:
            groups.setdefault(sample.group_id, []).append(sample)
        for members in groups.values():
            expected = asyncio.run(group_rm.rm(None, [from_wire(s) for s in members]))
            assert [s.reward for s in members] == pytest.approx(expected)


@pytest.mark.system
@pytest.mark.timeout(150)
def test_slime_style_tool_generate_and_custom_loss_train(tmp_path: Path, tiny_model_path: Path) -> None:
    """The retool-like generate (its sandbox runs only when the model writes <code>, which a tiny random model
    rarely does) and slime's custom-loss pair train a real run; the loss's own metric reaches train.jsonl."""
    run_dir = _run(tmp_path, tiny_model_path, "--rollout-max-response-len", "24",
                   "--custom-generate-function-path", "examples.slime_style.retool_generate:generate",
                   "--loss-type", "custom_loss",
                   "--custom-loss-function-path", "examples.slime_style.custom_loss:reinforce_loss",
                   "--off-policy-correction", "none")
    rows = [json.loads(line) for line in (run_dir / "metrics" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == STEPS
    for row in rows:
        # pi_old is the training forward here, so the loss's importance weight is exactly 1 on every token.
        assert row["is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
        assert np.isfinite(row["loss"])
