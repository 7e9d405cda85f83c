"""An eval round's gain since its set's first round, paired by prompt: the mean of each prompt's difference, and the
standard error of that mean, which is what a before/after claim on a fixed held-out set rests on."""

from __future__ import annotations

import json
import math
from collections import deque
from pathlib import Path

import numpy as np
import pytest

from actors.evaluator.gains import first_rounds, paired_gains, prompt_scores
from actors.evaluator.rounds import EvalRounds
from actors.runtime.metrics import MetricsWriter
from bus.schema import PromptGroup, Sample, ScoredGroup
from policies.rewards import REWARD_EXTRAS
from tests.actors.test_eval_rounds import Log, Writer, _config


def _scored(group: PromptGroup, rewards: list[float], correct: list[bool]) -> ScoredGroup:
    samples = [Sample(sample_id=f"{group.group_id}/{index}", group_id=group.group_id, index=index,
                      prompt=group.prompt, reward=reward, metadata={REWARD_EXTRAS: {"correct": right}},
                      response_length=3, tokens=np.zeros(5, dtype=np.int32), prompt_tokens=2)
               for index, (reward, right) in enumerate(zip(rewards, correct, strict=True))]
    return ScoredGroup(lease_id="L", group_id=group.group_id, samples=samples, worker_id="w")


def _round(rounds: EvalRounds, queue: deque[PromptGroup], version: int, rewards: list[list[float]]) -> None:
    rounds.start(version, weights_version=version)
    groups = [queue.popleft() for _ in rewards]
    for group, scores in zip(reversed(groups), reversed(rewards), strict=True):  # returned in any order
        rounds.record(_scored(group, scores, [score >= 1.0 for score in scores]))


@pytest.mark.unit
def test_later_rounds_report_their_gain_since_the_first_paired_by_prompt_with_its_standard_error(
        tmp_path: Path) -> None:
    config = _config(tmp_path, eval_prompts=4, n_samples_per_eval_prompt=2)
    queue: deque[PromptGroup] = deque()
    writer, scores = Writer(), MetricsWriter(tmp_path / "run", "eval_scores")
    rounds = EvalRounds(config, queue, writer=writer, log=Log(), scores_writer=scores)  # type: ignore[arg-type]
    before = [[0.0, 0.0], [1.0, 0.0], [1.0, 1.0], [0.0, 0.0]]  # the prompts differ in difficulty
    after = [[1.0, 0.0], [1.0, 1.0], [1.0, 1.0], [1.0, 0.0]]
    _round(rounds, queue, 0, before)
    _round(rounds, queue, 2, after)
    (_, first), (_, second) = writer.rows
    assert not any("/gain" in key for key in first)  # the first round is the baseline
    differences = np.array([0.5, 0.5, 0.0, 0.5])  # each prompt's mean reward, after minus before
    assert second["eval/held/gain/mean_reward"] == pytest.approx(differences.mean())
    assert second["eval/held/gain_se/mean_reward"] == pytest.approx(differences.std(ddof=1) / 2)
    assert second["eval/held/gain/reward/correct"] == pytest.approx(differences.mean())  # every 1.0 is right
    assert (second["eval/held/gain_prompts"], second["eval/held/gain_since"]) == (4, 0)
    # the unpaired error of the same rounds is wider: the prompts' spread in difficulty counts in it
    unpaired = math.hypot(np.std([np.mean(r) for r in before], ddof=1) / 2,
                          np.std([np.mean(r) for r in after], ddof=1) / 2)
    assert second["eval/held/gain_se/mean_reward"] < unpaired
    scores.close()
    rows = [json.loads(line) for line in scores.path.read_text().splitlines()]
    assert [(row["step"], row["set"]) for row in rows] == [(0, "held"), (2, "held")]
    assert [rows[0]["scores"][key]["mean_reward"] for key in sorted(rows[0]["scores"])] == [0.0, 0.5, 1.0, 0.0]


@pytest.mark.unit
def test_a_restarted_evaluator_pairs_with_the_first_round_written_before_it(tmp_path: Path) -> None:
    """The baselines come back from eval_scores.jsonl (a torn last line skipped), so round 4 after a restart still
    reports its gain since round 0."""
    path = tmp_path / "eval_scores.jsonl"
    path.write_text(json.dumps({"step": 0, "set": "held", "scores": {"0": {"mean_reward": 0.0},
                                                                     "1": {"mean_reward": 1.0}}}) + "\n"
                    + json.dumps({"step": 2, "set": "held", "scores": {"0": {"mean_reward": 1.0}}}) + "\n"
                    + '{"step": 4, "set": "he')
    assert first_rounds(path) == {"held": (0, {"0": {"mean_reward": 0.0}, "1": {"mean_reward": 1.0}})}
    assert first_rounds(tmp_path / "none.jsonl") == {}
    config = _config(tmp_path, eval_prompts=2, n_samples_per_eval_prompt=1)
    queue: deque[PromptGroup] = deque()
    writer = Writer()
    rounds = EvalRounds(config, queue, writer=writer, log=Log())  # type: ignore[arg-type]
    rounds.baselines = first_rounds(path)
    _round(rounds, queue, 4, [[1.0], [1.0]])
    [(_, metrics)] = writer.rows
    assert metrics["eval/held/gain/mean_reward"] == 0.5 and metrics["eval/held/gain_since"] == 0


@pytest.mark.unit
def test_only_prompts_both_rounds_scored_and_metrics_both_reported_are_paired() -> None:
    baseline = {"0": {"mean_reward": 0.0, "reward/correct": 0.0}, "1": {"mean_reward": 1.0}, "7": {"mean_reward": 0.2}}
    current = {"0": {"mean_reward": 1.0, "reward/correct": 1.0}, "1": {"mean_reward": 1.0, "reward/correct": 1.0},
               "9": {"mean_reward": 0.9}}  # 7 failed now, 9 failed in the baseline
    gains = paired_gains("held", baseline, current)
    assert gains == {"eval/held/gain/mean_reward": 0.5, "eval/held/gain_se/mean_reward": pytest.approx(0.5),
                     "eval/held/gain/reward/correct": 1.0, "eval/held/gain_prompts": 2}  # one pair: no error
    assert prompt_scores([], [{"correct": True}]) == {"reward/correct": 1.0}  # every sample failed its reward
