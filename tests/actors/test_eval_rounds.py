"""Where eval rounds go when the learner pushes: to versions the engines received and were pinned on, one per due
version reached.

The evaluator asks the learner to pin the first weights of the next due version or newer (`next_due`); the learner's
cadence takes the pin when such weights reach every engine. A due version trained while the engines were pinned,
and so never pushed, gives its round to the next version pushed.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from pathlib import Path

import numpy as np
import pytest

from actors.config import RunConfig, build_config
from actors.evaluator.actor import written_rounds
from actors.evaluator.rounds import EvalRounds, next_due
from bus.schema import PromptGroup, Sample, ScoredGroup
from policies.weight_versions import WeightCadence


def _config(tmp_path: Path, *, eval_prompts: int = 1, **overrides: object) -> RunConfig:
    prompts = tmp_path / "train.jsonl"
    prompts.write_text('{"input": "1+1=", "label": "2"}\n')
    eval_set = tmp_path / "held.jsonl"
    eval_set.write_text("".join(f'{{"input": "{n}+{n}=", "label": "{2 * n}"}}\n' for n in range(2, 2 + eval_prompts)))
    return build_config({"prompt_data": str(tmp_path / "train.jsonl"), "eval_prompt_data": ["held", str(eval_set)],
                         "eval_interval": 2, **overrides})


class Writer:
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.rows.append((step, metrics))


class Log:
    def info(self, *_: object, **__: object) -> None: ...

    warning = info


def _rounds(config: RunConfig) -> tuple[EvalRounds, deque[PromptGroup], Writer]:
    queue: deque[PromptGroup] = deque()
    writer = Writer()
    return EvalRounds(config, queue, writer=writer, log=Log()), queue, writer  # type: ignore[arg-type]


@pytest.mark.unit
@pytest.mark.parametrize(("learner_version", "pushed", "expected"), [
    (0, [0, 1, 2, 3, 4], [0, 2, 4]),  # every version pushed: every interval-th
    (0, [0, 2, 5, 6, 7], [0, 2, 5, 6]),  # 4 trained during round 2's pin, never pushed: its round goes to 5
    (0, [0, 1, 7, 8], [0, 7, 8]),  # 2, 4 and 6 skipped: one round for them, at 7
    (3, [3, 4, 5], [4]),  # a resumed run: its first weights get a round only if due themselves (3 is not)
])
def test_the_evaluators_pins_put_rounds_on_pushed_versions_one_per_due_version_reached(
        tmp_path: Path, learner_version: int, pushed: list[int], expected: list[int]) -> None:
    config = _config(tmp_path)
    rounds, queue, _ = _rounds(config)
    weights = WeightCadence(hold_timeout_s=60.0)
    weights.pin(next_due(config, learner_version - 1 if learner_version else None))
    for version in pushed:
        weights.push_ended(version, reached_every_engine=True)
        if (pinned := weights.holding()) is not None:
            rounds.start(pinned, weights_version=pinned)
            weights.release(pinned)  # the round reports before the next push, and the next due is armed with it
            weights.pin(next_due(config, pinned))
    assert sorted(rounds.started_versions) == expected
    assert [(g.weights_version, g.owner) for g in queue] == [(v, "evaluator") for v in expected]


@pytest.mark.unit
def test_next_due_counts_from_the_baseline_or_the_interval() -> None:
    config = build_config({"eval_prompt_data": ["held", "held.jsonl"], "eval_interval": 3})
    assert [next_due(config, after) for after in (None, 0, 2, 3, 5)] == [0, 3, 3, 6, 6]
    skipping = build_config({"eval_prompt_data": ["held", "held.jsonl"], "eval_interval": 3,
                             "skip_eval_before_train": True})
    assert next_due(skipping, None) == 3
    assert next_due(build_config({}), None) is None  # no eval sets: nothing is ever pinned


def _scored(group: PromptGroup, reward: float | None, version: int, *, length: int = 2) -> ScoredGroup:
    sample = Sample(sample_id=f"{group.group_id}/0", group_id=group.group_id, index=0, prompt=group.prompt,
                    reward=reward, token_versions=np.full(length, version, dtype=np.int32), response_length=length,
                    tokens=np.zeros(2 + length, dtype=np.int32), prompt_tokens=2)
    return ScoredGroup(lease_id="L", group_id=group.group_id, samples=[sample], worker_id="w")


@pytest.mark.unit
def test_a_round_is_written_once_with_its_groups_scored_however_often_they_come_back(tmp_path: Path) -> None:
    rounds, queue, writer = _rounds(_config(tmp_path, eval_prompts=2, n_samples_per_eval_prompt=1))
    rounds.start(2, weights_version=2)
    rounds.start(2, weights_version=2)  # asked again (the evaluator polls): one round
    first, second = list(queue)
    rounds.record(_scored(first, 1.0, 2))
    assert [g.group_id for g in rounds.groups_pending()] == [second.group_id]  # what is handed over again
    rounds.record(_scored(first, 0.0, 2))  # handed over again and scored twice: the first score stands
    rounds.record(_scored(second, 0.0, 2))
    assert [(step, metrics["eval/held/accuracy"], metrics["eval/held/off_version_samples"])
            for step, metrics in writer.rows] == [(2, 0.5, 0)]
    assert not rounds.pending and rounds.done_through == 2 and rounds.groups_pending() == []


@pytest.mark.unit
def test_a_round_reports_the_median_and_mean_length_of_its_scored_answers(tmp_path: Path) -> None:
    rounds, queue, writer = _rounds(_config(tmp_path, eval_prompts=4, n_samples_per_eval_prompt=1))
    rounds.start(0, weights_version=0)
    for group, length, reward in zip(list(queue), (10, 30, 200, 500), (1.0, 0.0, 1.0, None), strict=True):
        rounds.record(_scored(group, reward, 0, length=length))  # the unscored 500-token answer is not counted
    (_, metrics), = writer.rows
    assert metrics["eval/held/response_length/median"] == 30.0
    assert metrics["eval/held/response_length/mean"] == 80.0
    assert metrics["eval/held/failed_samples"] == 1


@pytest.mark.unit
def test_a_restarted_evaluator_does_not_start_rounds_eval_jsonl_already_holds(tmp_path: Path) -> None:
    metrics = tmp_path / "eval.jsonl"
    metrics.write_text(json.dumps({"step": 2, "eval/held/mean_reward": 0.5, "eval/held/pass@1": 0.5}) + "\n"
                       + '{"step": 4, "eval/held/mean_re')  # a line torn by the kill
    rounds, queue, _ = _rounds(_config(tmp_path, eval_prompts=2))
    rounds.reported = written_rounds(metrics)
    assert rounds.reported == {(2, "held")}
    rounds.start(2)
    assert not queue and not rounds.pending and rounds.done_through == 2
    rounds.start(4)
    assert len(queue) == 2 and rounds.pending


def _evaluator(tmp_path: Path, **run_settings: object) -> object:
    from actors.evaluator.actor import Evaluator
    from actors.runtime.context import ActorContext

    config = _config(tmp_path, eval_prompts=2)
    run = {"prompt_data": config.data.prompt_data, "eval_prompt_data": ["held", config.eval.sets["held"]],
           "eval_interval": 2, **run_settings}
    context = ActorContext(actor_id="evaluator", role="evaluator", actor_class="actors.evaluator.actor:Evaluator",
                           node_rank=0, head_address="tcp://127.0.0.1:1", run_dir=tmp_path / "run",
                           settings={"run": run})
    return Evaluator(context)


@pytest.mark.unit
@pytest.mark.parametrize(("learner_version", "written", "started", "expected"), [
    (None, [], [], None),  # the learner has not answered: nothing is armed yet
    (0, [], [], 0),  # a fresh run: the baseline
    (3, [], [], 4),  # resumed at 3 with no round written: the next due, not 3
    (5, [2], [], 4),  # restarted after writing round 2: the due after it
    (0, [], [0], 0),  # round 0 open: its version stays asked for until it reports
])
def test_the_evaluator_asks_to_pin_an_open_round_or_the_next_due_version(
        tmp_path: Path, learner_version: int | None, written: list[int], started: list[int],
        expected: int | None) -> None:
    async def scenario() -> int | None:
        evaluator = _evaluator(tmp_path)
        metrics = tmp_path / "run" / "metrics"
        metrics.mkdir(parents=True)
        (metrics / "eval.jsonl").write_text("".join(json.dumps({"step": v, "eval/held/mean_reward": 1.0}) + "\n"
                                                    for v in written))
        await evaluator.on_start()  # type: ignore[attr-defined]
        evaluator.learner_version, evaluator.publishes = learner_version, True  # type: ignore[attr-defined]
        for version in started:
            evaluator.rounds.start(version)  # type: ignore[attr-defined]
        try:
            return evaluator.next_pin()  # type: ignore[attr-defined]
        finally:
            await evaluator.on_stop()  # type: ignore[attr-defined]
            evaluator.zmq.destroy(linger=0)  # type: ignore[attr-defined]

    assert asyncio.run(scenario()) == expected
