"""slime's --eval-function-path: an eval round is one call of the user's function on a rollout worker pinned at
the evaluated version; its per-dataset results come back as the round's eval metrics."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from actors.config import build_config
from actors.evaluator.rounds import EvalRounds
from actors.extensions.load import round_function
from actors.extensions.points import WHOLE_ROUND
from actors.runtime.roles import runs_evaluator
from actors.slime_compat.eval_function import round_samples
from bus.codec import decode, encode
from bus.schema import PromptGroup, ScoredGroup
from tests.actors.test_eval_rounds import _rounds
from tests.support import slime_eval_function

FUNCTION = "tests.support.slime_eval_function"


def _config(tmp_path: Path, function: str = "generate_rollout"):
    prompts = tmp_path / "train.jsonl"
    prompts.write_text('{"input": "1+1=", "label": "2"}\n')
    return build_config({"prompt_data": str(prompts), "eval_function_path": f"{FUNCTION}:{function}",
                         "eval_interval": 2})


def _round(tmp_path: Path, function: str, version: int) -> tuple[EvalRounds, PromptGroup, list]:
    """Start `version`'s round, run its group as the rollout worker would, and send the result over the wire."""
    config = _config(tmp_path, function)
    rounds, queue, writer = _rounds(config)
    rounds.start(version, weights_version=version)
    (group,) = queue
    generate = round_function(config, "http://127.0.0.1:30123")
    samples = asyncio.run(asyncio.wait_for(generate(None, group), 30))
    rounds.record(decode(encode(ScoredGroup(lease_id="l", group_id=group.group_id, samples=samples,
                                            worker_id="rollout-0"))))
    return rounds, group, writer.rows


@pytest.mark.integration
def test_an_eval_round_is_one_call_of_the_function_pinned_at_its_version_and_its_datasets_are_recorded(
        tmp_path: Path) -> None:
    slime_eval_function.CALLS.clear()
    rounds, group, rows = _round(tmp_path, "generate_rollout", 4)
    assert (group.weights_version, group.owner, group.is_eval, group.metadata) == (4, "evaluator", True,
                                                                                    {WHOLE_ROUND: 4})
    assert slime_eval_function.CALLS == [{"rollout_id": 4, "evaluation": True, "server": ("127.0.0.1", 30123)}]
    assert rows == [(4, {"eval/custom_score": 40.0,
                         "eval/math/mean_reward": 0.75, "eval/math/truncated_ratio": 0.25, "eval/math/samples": 4,
                         "eval/code/mean_reward": 0.5, "eval/code/truncated_ratio": 0.0, "eval/code/samples": 2})]
    assert not rounds.pending and rounds.done_through == 4

    restarted, queue, _ = _rounds(_config(tmp_path))
    restarted.reported = {(4, "math"), (4, "code")}  # what written_rounds reads back from eval.jsonl
    restarted.start(4)
    assert not queue and not restarted.pending  # a round written before a restart is not run again


@pytest.mark.integration
def test_slimes_legacy_answer_a_bare_data_dict_is_read_too(tmp_path: Path) -> None:
    _, _, rows = _round(tmp_path, "legacy", 0)
    assert rows == [(0, {"eval/math/mean_reward": 0.5, "eval/math/truncated_ratio": 0.0, "eval/math/samples": 2})]


@pytest.mark.unit
@pytest.mark.parametrize(("output", "problem"), [
    ([1.0], r"returned list; expected RolloutFnEvalOutput or a dict"),
    ({"math": {"scores": [1.0]}}, r"dataset 'math': 'rewards' must be a non-empty list of finite numbers"),
    ({"math": {"rewards": [1.0, float("nan")]}}, r"dataset 'math': 'rewards' must be"),
    ({"math": {"rewards": [1.0, 0.0], "truncated": [False]}}, r"dataset 'math': 2 rewards, 1 truncated flags"),
])
def test_an_answer_that_is_not_slimes_eval_output_is_named(output: object, problem: str) -> None:
    group = PromptGroup(group_id="eval:function:2:0", prompt="", metadata={WHOLE_ROUND: 2})
    with pytest.raises(ValueError, match=rf"--eval-function-path my\.module:evaluate:? .*{problem}"):
        round_samples(output, group, path="my.module:evaluate")


@pytest.mark.unit
def test_the_eval_function_runs_an_evaluator_and_needs_an_interval(tmp_path: Path) -> None:
    assert runs_evaluator(_config(tmp_path))
    with pytest.raises(ValueError, match="eval_function_path needs eval_interval"):
        build_config({"eval_function_path": f"{FUNCTION}:generate_rollout"})
