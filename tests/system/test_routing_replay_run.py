"""Rollout routing replay (R3) through launcher.py: the engines record each token's experts (a torch engine, or an
SGLang-compatible server asked with return_routed_experts), samples carry them over the bus, and the learner's
policy forwards route there (a tiny Qwen3-MoE model).

Megatron's R2 (--use-routing-replay: the routes of the learner's own pi_old forward) runs in the slime MoE script's
Megatron run, tests/system/test_slime_script_run.py, which has its two learner ranks and expert parallelism."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bus.codec import decode
from tools.make_arithmetic_data import make_arithmetic_data
from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model

REPO = Path(__file__).resolve().parents[2]


ENGINES = {"torch": [],
           "sglang": ["--rollout-engine", "sglang", "--sglang-server-module", "tools.standins.sglang_server"]}
# (engine, learner backend): each engine's routes reach a learner, and each backend replays routes an engine sent.
# The torch engine into the torch backend adds no claim: the samples' routes are checked the same way whichever
# learner reads them, and the torch backend's replay is the SGLang run's.
RUNS = [("sglang", "torch"), ("torch", "megatron")]


def tiny_moe_run(tmp_path: Path, tiny_model_cache: Path, *flags: str) -> list[dict]:
    """A launcher run of 3 batches with a tiny Qwen3-MoE on sums, with `flags`; the rows of its train.jsonl."""
    model = cached_tiny_model(tiny_model_cache, TinyModelSpec(family="qwen3_moe"))
    data = make_arithmetic_data(tmp_path / "data", max_operand=9, eval_size=10)["train"]
    run_dir = tmp_path / "run"
    command = [sys.executable, str(REPO / "launcher.py"), "--head", "--run-dir", str(run_dir),
               "--hf-checkpoint", str(model), "--prompt-data", str(data), "--num-rollout", "3",
               "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "6",
               "--rollout-workers", "1", "--reward-workers", "1", "--seed", "2", "--lr", "1e-3",
               "--torch-threads", "1", "--final-eval-timeout", "0", "--no-progress", "--no-use-tensorboard",
               "--no-plots", *flags]
    finished = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=280)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics" / "train.jsonl").read_text().splitlines()]


@pytest.mark.system
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("engine", "backend"), RUNS)
def test_samples_carry_the_engines_routes_to_a_learner_that_replays_them(tmp_path: Path, tiny_model_cache: Path,
                                                                        engine: str, backend: str) -> None:
    batches = tmp_path / "batches"
    rows = tiny_moe_run(tmp_path, tiny_model_cache, "--use-rollout-routing-replay", "--off-policy-correction", "tis",
                        "--save-debug-rollout-data", str(batches), "--train-backend", backend, *ENGINES[engine])
    assert len(rows) == 3
    assert all("train_rollout_logprob_abs_diff" in row for row in rows), sorted(rows[0])
    samples = [sample for path in sorted(batches.glob("*.msgpack")) for sample in decode(path.read_bytes()).samples]
    assert len(samples) == 3 * 4 * 2
    for sample in samples:
        assert (sample.moe_layers, sample.moe_top_k) == (2, 2)
        routes = np.asarray(sample.routed_experts)
        assert routes.shape == ((len(sample.tokens) - 1) * 4,)
        assert routes.min() >= 0 and routes.max() < 4  # TinyModelSpec's four experts
