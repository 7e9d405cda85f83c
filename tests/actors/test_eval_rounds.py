"""Where eval rounds go when the learner pushes: to versions the engines received, one per due version reached.

The buffer (`EvalRounds.weights_arrived`) and the learner's pins (`WeightCadence.push_ended`) decide this separately,
from the versions each saw; they must agree, or the learner holds the engines for a round that never starts (or
lets them go during one that did).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from actors.buffer.core import BufferCore
from actors.config import RunConfig, build_config
from actors.data.prompts import PromptRecord, PromptSource
from actors.eval.rounds import EvalRounds, round_due
from policies.weight_versions import WeightCadence


def _config(tmp_path: Path, **overrides: object) -> RunConfig:
    prompts = tmp_path / "train.jsonl"
    prompts.write_text('{"input": "1+1=", "label": "2"}\n')
    eval_set = tmp_path / "held.jsonl"
    eval_set.write_text('{"input": "2+2=", "label": "4"}\n')
    return build_config({"prompt_data": str(prompts), "eval_prompt_data": ["held", str(eval_set)],
                         "eval_interval": 2, **overrides})


def _rounds(config: RunConfig) -> tuple[EvalRounds, BufferCore]:
    core = BufferCore(source=PromptSource([PromptRecord(0, "1+1=", "2", {})], seed=1), n_samples=1,
                      groups_per_batch=1, max_staleness=0, lease_timeout=10.0)
    return EvalRounds(config, core.eval_queue, writer=None, log=None), core


@pytest.mark.unit
@pytest.mark.parametrize(("pushed", "expected"), [
    ([0, 1, 2, 3, 4], [0, 2, 4]),  # every version pushed: every interval-th
    ([0, 2, 5, 6, 7], [0, 2, 5, 6]),  # 4 trained during round 2's hold, never pushed: its round goes to 5
    ([0, 1, 7, 8], [0, 7, 8]),  # 2, 4 and 6 skipped: one round for them, at 7
    ([3, 4, 5], [4]),  # a resumed run: its first weights get a round only if due themselves (3 is not)
])
def test_the_buffer_and_the_learners_pins_put_rounds_on_the_same_pushed_versions(
        tmp_path: Path, pushed: list[int], expected: list[int]) -> None:
    config = _config(tmp_path)
    rounds, core = _rounds(config)
    weights = WeightCadence(pins=functools.partial(round_due, config), hold_timeout_s=60.0)
    pinned = []
    for version in pushed:
        rounds.weights_arrived(version)
        weights.push_ended(version, reached_every_engine=True)
        if weights.holding() == version:
            pinned.append(version)
            weights.release(version)  # the round reports before the next push
            assert weights.holding() is None
    assert sorted(rounds.started_versions) == expected
    assert pinned == expected
    assert [int(group.group_id.split(":")[2]) for group in core.eval_queue] == expected


@pytest.mark.unit
def test_weights_announced_again_or_out_of_order_start_no_second_round(tmp_path: Path) -> None:
    rounds, _ = _rounds(_config(tmp_path))
    for version in (0, 0, 2, 2, 1, 2):  # announcements repeat the weights every engine has until the next push
        rounds.weights_arrived(version)
    assert sorted(rounds.started_versions) == [0, 2]


@pytest.mark.unit
def test_round_due_counts_the_due_versions_between_two_pushes(tmp_path: Path) -> None:
    config = _config(tmp_path, eval_interval=3)
    assert round_due(config, None, 0) and not round_due(config, None, 1)
    assert round_due(config, -1, 1)  # version 0's baseline, reached by weights 1 (fresh engines never announced)
    assert not round_due(config, 1, 2) and round_due(config, 2, 3) and round_due(config, 1, 5)
    assert not round_due(config, 3, 5) and not round_due(config, 5, 5) and not round_due(config, 6, 4)
    skipping = _config(tmp_path, eval_interval=3, skip_eval_before_train=True)
    assert not round_due(skipping, -1, 2) and round_due(skipping, -1, 3)
