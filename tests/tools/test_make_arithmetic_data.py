"""The real model's tasks: each pair of numbers is one question, the held-out pairs never appear in training, and
every label is the sum the question asks for."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tools.make_arithmetic_data import make_sum_questions, make_two_digit_sum_questions, make_word_problems

pytestmark = pytest.mark.unit


def _numbers(question: str) -> tuple[int, int]:
    a, b = map(int, re.findall(r"\d+", question))
    return a, b


@pytest.mark.parametrize("make, pairs", [(make_sum_questions, 90 * 9), (make_two_digit_sum_questions, 90 * 90),
                                         (make_word_problems, 50 * 8)])
def test_held_out_pairs_are_never_trained_and_every_label_is_the_sum(make, pairs: int, tmp_path: Path) -> None:
    paths = make(tmp_path, eval_size=100)
    rows = {name: [json.loads(line) for line in path.read_text().splitlines()] for name, path in paths.items()}
    held_out = {_numbers(row["input"]) for row in rows["eval"]}
    trained = {_numbers(row["input"]) for row in rows["train"]}
    assert len(held_out) == 100 and len(trained) == pairs - 100 and not held_out & trained
    for row in rows["eval"] + rows["train"]:
        assert row["label"] == str(sum(_numbers(row["input"])))
    assert make(tmp_path / "again", eval_size=100)["eval"].read_text() == paths["eval"].read_text()  # reproducible


def test_multi_step_problems_are_new_when_held_out_and_their_worked_solutions_earn_the_full_reward(
        tmp_path: Path) -> None:
    from policies.registry import resolve_reward
    from policies.rewards.types import RewardInput
    from tools.make_arithmetic_data import make_multi_step_problems

    paths = make_multi_step_problems(tmp_path, eval_size=100, sft_size=50)
    rows = {name: [json.loads(line) for line in path.read_text().splitlines()] for name, path in paths.items()}
    assert len(rows["eval"]) == 100 and len(rows["sft"]) == 50
    assert not {row["input"] for row in rows["eval"]} & {row["input"] for row in rows["train"]}
    assert {row["input"] for row in rows["sft"]} <= {row["input"] for row in rows["train"]}
    worked = resolve_reward("worked_steps")
    for row in rows["train"]:
        start, *amounts = map(int, re.findall(r"\d+", row["input"]))
        assert 4 <= len(row["label"]) == len(amounts) <= 6
        steps = zip([start, *row["label"]], row["label"], amounts, strict=False)
        assert all(abs(after - before) == amount for before, after, amount in steps)  # one change from the last
        assert worked(RewardInput(prompt=row["input"], response=row["solution"], label=row["label"],
                                  finish_reason="stop"))["correct"]
    assert make_multi_step_problems(tmp_path / "again", eval_size=100)["eval"].read_text() == \
        paths["eval"].read_text()  # reproducible
