"""A reward's extra fields (format, correctness) travel with the sample and become means in the metrics of the
learner's step and of the eval rounds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from actors.evaluator.rounds import EvalRounds
from actors.learner.step import rollout_metrics
from bus.schema import Sample, ScoredGroup
from policies.rewards import REWARD_EXTRAS
from tests.actors.test_eval_rounds import _config, _rounds
from tests.actors.test_reward_prescored import _worker


def _sample(index: int, response: str, *, group: str = "g", extras: dict | None = None) -> Sample:
    return Sample(sample_id=f"{group}/{index}", group_id=group, index=index, prompt="What is 3 + 4?",
                  prompt_tokens=1, tokens=np.array([1, 2], dtype=np.int32), response=response, response_length=1,
                  label="7", reward=None if extras is None else float(extras["correct"]),
                  loss_mask=np.ones(1, dtype=np.int8), status="completed",
                  metadata={} if extras is None else {REWARD_EXTRAS: extras})


@pytest.mark.unit
async def test_the_reward_worker_keeps_what_the_reward_said_beside_the_reward(tmp_path: Path) -> None:
    async with _worker(tmp_path, rm_type="final_number") as worker:
        scored = await worker.score_samples([_sample(0, "7"), _sample(1, "3 + 4 = 7"), _sample(2, "8")])
    assert [s.reward for s in scored] == [1.0, 1.0, 0.0]
    assert [s.metadata[REWARD_EXTRAS] for s in scored] == [
        {"correct": True, "format_ok": True, "truncated": False},
        {"correct": True, "format_ok": False, "truncated": False},
        {"correct": False, "format_ok": True, "truncated": False},
    ]


@pytest.mark.unit
def test_the_learner_logs_the_mean_of_each_extra_over_the_samples_that_report_it() -> None:
    samples = [_sample(0, "7", extras={"correct": True, "format_ok": True, "judge": "ok"}),
               _sample(1, "3 + 4 = 7", extras={"correct": True, "format_ok": False}),
               _sample(2, "8", extras={"correct": False, "format_ok": True}),
               _sample(3, "?")]  # scored by a reward without extras
    metrics = rollout_metrics(samples, staleness=[0, 0, 0, 0])
    assert metrics["reward/correct"] == pytest.approx(2 / 3)
    assert metrics["reward/format_ok"] == pytest.approx(2 / 3)
    assert "reward/judge" not in metrics  # not a number: no mean


class _RecordingWriter:
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict]] = []

    def write(self, version: int, metrics: dict) -> None:
        self.rows.append((version, metrics))


class _Log:
    def info(self, *args: object, **kwargs: object) -> None:
        pass


@pytest.mark.unit
def test_an_eval_round_logs_the_mean_of_each_extra(tmp_path: Path) -> None:
    rounds, queue, _ = _rounds(_config(tmp_path))
    writer = _RecordingWriter()
    rounds = EvalRounds(rounds.config, queue, writer=writer, log=_Log())
    rounds.start(0)
    group_id = queue[0].group_id
    samples = [_sample(0, "7", group=group_id, extras={"correct": True, "format_ok": False})]
    rounds.record(ScoredGroup(lease_id="lease", group_id=group_id, samples=samples, worker_id="reward-0-0"))
    [(version, metrics)] = writer.rows
    assert version == 0
    assert metrics["eval/held/reward/correct"] == 1.0 and metrics["eval/held/reward/format_ok"] == 0.0
    assert metrics["eval/held/accuracy"] == 1.0


@pytest.mark.unit
def test_the_progress_line_shows_what_the_reward_counts_as_right() -> None:
    from actors.report.progress import describe

    shaped = {"step": 3, "rollout/reward_mean": 0.4, "rollout/accuracy": 0.1, "reward/correct": 0.6}
    assert "reward 0.400 acc 0.600" in describe(shaped)  # half credit for a wordy right answer is still right
    assert "acc 0.100" in describe({"step": 3, "rollout/reward_mean": 0.4, "rollout/accuracy": 0.1})
