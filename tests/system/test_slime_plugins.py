"""Short real runs with slime-style plugins over the SGLang-compatible CPU server, each loaded by its slime flag
and detected by its signature: generate, rm, sample hook, filters, reward post-process, advantage function,
custom loss."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from actors.slime_compat.sample import from_wire
from bus.codec import decode
from examples.slime_style import answer_rm, batch_hooks, group_rm
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
        "--rollout-engine", "sglang", "--sglang-server-module", "tools.standins.sglang_server",
        "--final-eval-timeout", "0", "--heartbeat-interval", "0.25", "--weight-transfer-timeout", "20",
        "--no-progress", "--no-use-tensorboard", "--no-plots", *plugin_flags,
    ]
    finished = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=140)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    return run_dir


@pytest.mark.system
@pytest.mark.timeout(150)
def test_slime_style_generate_rm_and_batch_hooks_drive_a_training_run(tmp_path: Path, tiny_model_path: Path) -> None:
    """Seven slime plugins in one run: generate, group rm, sample hook, dynamic filter, buffer filter, reward
    post-process and advantage function, each loaded unchanged by its slime flag, dotted as slime spells it."""
    debug_dir = tmp_path / "batches"
    run_dir = _run(tmp_path, tiny_model_path, "--rollout-max-response-len", "96",
                   "--custom-generate-function-path", "examples.slime_style.search_generate.generate",
                   "--custom-rm-path", "examples.slime_style.group_rm.rm", "--group-rm",
                   "--rollout-sample-hook-path", "examples.slime_style.batch_hooks.skip_unanswered",
                   "--dynamic-sampling-filter-path", "examples.slime_style.batch_hooks.distinct_responses",
                   "--buffer-filter-path", "examples.slime_style.buffer_filter.highest_variance_first",
                   "--custom-reward-post-process-path", "examples.slime_style.batch_hooks.centred_with_length_cost",
                   "--custom-advantage-function-path", "examples.slime_style.advantage.discounted_return",
                   "--save-debug-rollout-data", str(debug_dir))

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    batches = sorted(debug_dir.glob("batch_*.msgpack"))
    rows = [json.loads(line) for line in (run_dir / "metrics" / "train.jsonl").read_text().splitlines()]
    assert len(batches) == len(rows) == STEPS
    for path, row in zip(batches, rows, strict=True):
        samples = decode(path.read_bytes()).samples
        for sample in samples:
            response = sample.tokens[sample.prompt_tokens:]
            mask = np.asarray(sample.loss_mask)
            question = sample.prompt if isinstance(sample.prompt, str) else sample.prompt[-1]["content"]
            block = len(tokenizer(information(question, CORPUS), add_special_tokens=False)["input_ids"])
            assert block < len(response)
            assert not mask[:block].any(), "retrieved passage was trained on"
            # The sample hook ran on every sample: an unanswered response is kept but none of it is trained.
            assert sample.metadata["answered"] == bool(re.search(r"-?\d", sample.response))
            assert mask[block:].all() if sample.metadata["answered"] else not mask.any()
            assert sample.rollout_log_probs is not None and np.all(sample.rollout_log_probs[block:] < 0)
        groups: dict[str, list] = {}
        for sample in samples:
            groups.setdefault(sample.group_id, []).append(sample)
        expected_post = []
        for members in groups.values():
            assert len({s.response.strip() for s in members}) > 1  # the dynamic filter let no identical group by
            expected = asyncio.run(group_rm.rm(None, [from_wire(s) for s in members]))
            assert [s.reward for s in members] == pytest.approx(expected)  # raw rewards, as the rm gave them
            mean = float(np.mean(expected))
            expected_post += [r - mean - batch_hooks.LENGTH_COST * s.response_length / 96
                              for r, s in zip(expected, members, strict=True)]
        # The learner trained on the post-process's rewards, not on the rm's.
        assert row["rollout/post_processed_reward_mean"] == pytest.approx(float(np.mean(expected_post)), abs=1e-6)
        assert np.isfinite(row["loss"])


@pytest.mark.system
@pytest.mark.timeout(150)
def test_slime_style_tool_generate_and_custom_loss_train(tmp_path: Path, tiny_model_path: Path) -> None:
    """The retool-like generate (its sandbox runs only when the model writes <code>, which a tiny random model
    rarely does), a per-sample rm and slime's custom-loss pair train a real run; the loss's metric reaches
    train.jsonl."""
    debug_dir = tmp_path / "batches"
    run_dir = _run(tmp_path, tiny_model_path, "--rollout-max-response-len", "24",
                   "--custom-generate-function-path", "examples.slime_style.retool_generate:generate",
                   "--custom-rm-path", "examples.slime_style.answer_rm:rm",
                   "--loss-type", "custom_loss",
                   "--custom-loss-function-path", "examples.slime_style.custom_loss:reinforce_loss",
                   "--off-policy-correction", "none", "--save-debug-rollout-data", str(debug_dir))
    rows = [json.loads(line) for line in (run_dir / "metrics" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == STEPS
    for path in sorted(debug_dir.glob("batch_*.msgpack")):  # slime's per-sample rm(args, sample) scored them
        for sample in decode(path.read_bytes()).samples:
            assert sample.reward == asyncio.run(answer_rm.rm(None, from_wire(sample)))
    for row in rows:
        # pi_old is the training forward here, so the loss's importance weight is exactly 1 on every token.
        assert row["is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
        assert np.isfinite(row["loss"])
