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


def agent_run(model: Path, tmp_path: Path, agent: str, samples_per_prompt: int) -> list[Any]:
    """A short run whose episodes are `agent`'s (in tmp_path/run); the samples of its trained batches, once it
    trained on each.
    The tiny model's template leaves tools out and a description would not fit its context: none is given."""
    data = make_arithmetic_data(tmp_path / "data", max_operand=9, eval_size=4)["train"]
    run_dir, batches = tmp_path / "run", tmp_path / "batches"
    command = [
        sys.executable, str(REPO / "launcher.py"), "--head", "--run-dir", str(run_dir),
        "--hf-checkpoint", str(model), "--prompt-data", str(data), "--num-rollout", str(STEPS),
        "--rollout-batch-size", "2", "--n-samples-per-prompt", str(samples_per_prompt),
        "--rollout-max-response-len", "8",
        "--max-staleness", "1", "--agent-function-path", agent, "--no-agent-describe-tools",
        "--custom-rm-path", "tests.support.reward_plugins:digit_share", "--save-debug-rollout-data", str(batches),
        # The default heartbeat: nothing here is killed, so nothing needs its death noticed fast, and a worker with
        # eight episodes in flight on a busy machine can miss a short beat's deadline and be declared dead.
        "--final-eval-timeout", "0",
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
def test_agents_of_each_client_and_one_that_rewrites_its_context_train_and_the_audit_finds_nothing_lost(
        tiny_model_path: Path, tmp_path: Path) -> None:
    """One run, each group's four samples the episodes of four agents (tests.support.agents), so one launcher run
    serves what took three:
    - the example agent of the OpenAI client's Chat Completions, its Responses API and the Anthropic client each
      run multi-turn episodes that train on the model's turns only;
    - an agent that rewrites its context (the main conversation, a sub-agent's fresh context and a compacted
      history) trains each episode as three segments with the episode's one reward, counted as one episode by the
      buffer and the certificate."""
    samples = agent_run(tiny_model_path, tmp_path, "tests.support.agents:every_client_or_rewrites_its_context",
                        samples_per_prompt=4)
    episodes = by_episode(samples)
    assert len(episodes) == STEPS * 2 * 4
    trees = [segments for segments in episodes.values() if len(segments) > 1]
    single = [segments[0] for segments in episodes.values() if len(segments) == 1]
    assert len(trees) == STEPS * 2 and len(single) == STEPS * 2 * 3  # one context-rewriting episode per group
    apis = sorted(sample.metadata["api"] for sample in single)
    assert apis == sorted(["chat", "responses", "anthropic"] * STEPS * 2)
    assert_reviewed_episodes(tiny_model_path, single)
    for segments in trees:
        assert [(s.segment, s.parent_segment, s.ends_episode) for s in segments] == [
            (0, None, False), (1, 0, False), (2, 0, True)]
        assert len({s.reward for s in segments}) == 1 and all(np.any(s.loss_mask) for s in segments)
    run_dir = tmp_path / "run"
    rows = [json.loads(line) for line in (run_dir / "metrics" / "train.jsonl").read_text().splitlines()]
    # each group: three episodes of one segment and one of three
    assert [row["multiturn/segments_per_episode"] for row in rows] == [(1 + 1 + 1 + 3) / 4] * STEPS
    report = audit(run_dir)
    assert report.ok and report.trained_samples == len(samples), report.problems
    verdict = prompt_verdict(run_dir)
    assert verdict["verdict"] == "pass"
    assert verdict["samples"] == {"trained": len(episodes), "left_out": 0, "unaccounted": 0,
                                  "trained_segments": len(samples)}
    certificate = json.loads((run_dir / "integrity.json").read_text())  # the run's own, written as it ended
    assert certificate["ok"] and certificate["checks"]["prompts"]["samples"]["unaccounted"] == 0
