"""An agent written against the OpenAI client library drives a real run through launcher.py (#18): every sample is
one episode on the rollout worker's endpoint, and the learner trains on its model turns only. An agent that
rewrites its context (#58) trains each episode as a tree of segments, and the audit finds nothing lost."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from transformers import AutoTokenizer

from actors.buffer.accounting import prompt_verdict
from bus.codec import decode
from bus.episodes import by_episode
from examples.openai_agent import REVIEW
from tools.audit_run import audit
from tools.make_arithmetic_data import make_arithmetic_data

REPO = Path(__file__).resolve().parents[2]
STEPS = 2


def agent_run(model: Path, tmp_path: Path, agent: str) -> list[Any]:
    """A short run whose episodes are `agent`'s (in tmp_path/run); the samples of its trained batches, once it
    trained on each.
    The tiny model's template leaves tools out and a description would not fit its context: none is given."""
    data = make_arithmetic_data(tmp_path / "data", max_operand=9, eval_size=4)["train"]
    run_dir, batches = tmp_path / "run", tmp_path / "batches"
    command = [
        sys.executable, str(REPO / "launcher.py"), "--head", "--run-dir", str(run_dir),
        "--hf-checkpoint", str(model), "--prompt-data", str(data), "--num-rollout", str(STEPS),
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "8",
        "--max-staleness", "1", "--agent-function-path", agent, "--no-agent-describe-tools",
        "--custom-rm-path", "tests.support.reward_plugins:digit_share", "--save-debug-rollout-data", str(batches),
        "--final-eval-timeout", "0", "--heartbeat-interval", "0.25",
        "--no-progress", "--no-use-tensorboard", "--no-plots",
    ]
    finished = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=140)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == STEPS and all(row["train/grad_norm"] > 0 for row in rows)
    return [sample for path in sorted(batches.glob("batch_*.msgpack")) for sample in decode(path.read_bytes()).samples]


def assert_reviewed_episodes(model: Path, samples: list[Any]) -> None:
    """Every sample is a whole episode: the agent's review is masked context, the model's turns are trained on."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    for sample in samples:
        response = np.asarray(sample.tokens[sample.prompt_tokens:])
        mask = np.asarray(sample.loss_mask, dtype=bool)
        assert sample.metadata["turns"] >= 2, "the agent's follow-up turn is missing"
        masked_text = tokenizer.decode(response[~mask].tolist())
        assert f"<|im_start|>user\n{REVIEW}<|im_end|>" in masked_text
        assert REVIEW not in tokenizer.decode(response[mask].tolist())
        assert np.all(np.asarray(sample.rollout_log_probs)[mask] < 0)


@pytest.mark.system
@pytest.mark.timeout(150)
def test_an_openai_client_agent_runs_multi_turn_episodes_that_train(tiny_model_path: Path, tmp_path: Path) -> None:
    assert_reviewed_episodes(tiny_model_path, agent_run(tiny_model_path, tmp_path, "examples.openai_agent:solve"))


@pytest.mark.system
@pytest.mark.timeout(150)
def test_responses_and_anthropic_client_agents_run_episodes_that_train(tiny_model_path: Path,
                                                                      tmp_path: Path) -> None:
    """One run, its samples alternating between the Responses client and the Anthropic client."""
    samples = agent_run(tiny_model_path, tmp_path, "tests.support.agents:responses_or_anthropic")
    assert {sample.metadata["api"] for sample in samples} == {"responses", "anthropic"}
    assert_reviewed_episodes(tiny_model_path, samples)


@pytest.mark.system
@pytest.mark.timeout(150)
def test_episodes_whose_agent_rewrites_its_context_train_as_trees_and_the_audit_finds_nothing_lost(
        tiny_model_path: Path, tmp_path: Path) -> None:
    """Each episode: the main conversation, a sub-agent's fresh context and a compacted history, three segments
    that train, with the episode's one reward, counted as one episode by the buffer and the certificate."""
    samples = agent_run(tiny_model_path, tmp_path, "tests.support.agents:rewrites_its_context")
    episodes = by_episode(samples)
    assert len(episodes) == STEPS * 2 * 2 and len(samples) == 3 * len(episodes)
    for segments in episodes.values():
        assert [(s.segment, s.parent_segment, s.ends_episode) for s in segments] == [
            (0, None, False), (1, 0, False), (2, 0, True)]
        assert len({s.reward for s in segments}) == 1 and all(np.any(s.loss_mask) for s in segments)
    run_dir = tmp_path / "run"
    rows = [json.loads(line) for line in (run_dir / "metrics" / "train.jsonl").read_text().splitlines()]
    assert [row["multiturn/segments_per_episode"] for row in rows] == [3.0] * STEPS
    report = audit(run_dir)
    assert report.ok and report.trained_samples == len(samples), report.problems
    verdict = prompt_verdict(run_dir)
    assert verdict["verdict"] == "pass"
    assert verdict["samples"] == {"trained": len(episodes), "left_out": 0, "unaccounted": 0,
                                  "trained_segments": len(samples)}
    certificate = json.loads((run_dir / "integrity.json").read_text())  # the run's own, written as it ended
    assert certificate["ok"] and certificate["checks"]["prompts"]["samples"]["unaccounted"] == 0
