"""Two synchronous runs with the same --seed generate the same samples and train to the same numbers.

With --deterministic-inference (batch-invariant engines) and --deterministic-mode (ordered kernels in the learner's
backward), the two runs decode in batches of other shapes by construction (two rollout workers
against one that decodes at most 3 sequences at a time): which worker generates a group, and what else its engine
batches beside it, must change neither the tokens nor their log-probs, bit for bit. (A fully-async run is not
repeatable; that its recording replays its training exactly is checked in test_debug_runs.py, on the recording its
training-only runs replay.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bus.codec import decode
from tools.make_arithmetic_data import make_arithmetic_data

REPO = Path(__file__).resolve().parents[2]
STEPS = 3


def _run(tmp_path: Path, model: Path, data: Path, name: str, seed: int, decoding: list[str],
         steps: int = STEPS) -> Path:
    run_dir = tmp_path / name
    command = [
        sys.executable, str(REPO / "launcher.py"), "--head", "--run-dir", str(run_dir), "--hf-checkpoint", str(model),
        "--prompt-data", str(data), "--num-rollout", str(steps), "--rollout-batch-size", "4",
        "--n-samples-per-prompt", "4", "--rollout-max-response-len", "6", "--rollout-temperature", "1.0",
        "--max-staleness", "0", *decoding, "--reward-workers", "1", "--seed", str(seed),
        "--save-debug-rollout-data", str(run_dir / "batches"), "--torch-threads", "1",
        "--final-eval-timeout", "0", "--no-progress", "--no-use-tensorboard", "--no-plots",
    ]
    finished = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=150)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    return run_dir


def _responses(run_dir: Path) -> list[list[tuple[str, list[int]]]]:
    """Per batch, in the batch's order: each sample's id and response tokens."""
    batches = []
    for path in sorted((run_dir / "batches").glob("batch_*.msgpack")):
        samples = decode(path.read_bytes()).samples
        batches.append([(s.sample_id, np.asarray(s.tokens[s.prompt_tokens:]).tolist()) for s in samples])
    return batches


def _log_probs(run_dir: Path) -> list[list[list[float]]]:
    """Per batch, each sample's rollout log-probs as Python floats (compared exactly)."""
    return [[np.asarray(s.rollout_log_probs).tolist() for s in decode(path.read_bytes()).samples]
            for path in sorted((run_dir / "batches").glob("batch_*.msgpack"))]


def _training(run_dir: Path) -> list[tuple[float, float, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics" / "train.jsonl").read_text().splitlines()]
    return [(row["rollout/reward_mean"], row["loss"], row["grad_norm"]) for row in rows]


@pytest.mark.system
@pytest.mark.timeout(400)
def test_the_same_seed_gives_the_same_samples_log_probs_and_training_in_any_decode_batch(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    data = make_arithmetic_data(tmp_path / "data", max_operand=9, eval_size=10)["train"]
    deterministic = ["--deterministic-inference", "--deterministic-mode"]
    two_workers = ["--rollout-workers", "2", *deterministic]
    first = _run(tmp_path, tiny_model_path, data, "first", seed=11, decoding=two_workers)
    second = _run(tmp_path, tiny_model_path, data, "second", seed=11,
                  decoding=["--rollout-workers", "1", "--rollout-max-batch-size", "3", *deterministic])
    # One step is enough to show the seed deciding: the first batch is generated before any training in both runs.
    other = _run(tmp_path, tiny_model_path, data, "other", seed=12, decoding=two_workers, steps=1)

    assert len(_responses(first)) == STEPS
    assert _responses(first) == _responses(second)  # same samples, same order: exactly
    assert _log_probs(first) == _log_probs(second)  # mu, as the loss reads it
    assert _training(first) == _training(second)  # bit for bit, not approximately
    assert _responses(first)[0] != _responses(other)[0]  # and the seed is what decides them
