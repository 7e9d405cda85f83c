"""The PPO experiment's mixed data: products replace a share of the sums, nothing else changes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.experiments.ppo_critic import mix_in_products
from tools.make_arithmetic_data import make_sum_questions


@pytest.mark.unit
def test_a_share_of_the_sums_becomes_products_with_their_right_answers(tmp_path: Path) -> None:
    data = make_sum_questions(tmp_path, eval_size=100)
    sums = [json.loads(line) for line in data["train"].read_text().splitlines()]
    mixed = [json.loads(line) for line in mix_in_products(data["train"], 0.25).read_text().splitlines()]
    products = [row for row in mixed if " * " in row["input"]]
    assert len(mixed) == len(sums) and len(products) == round(0.25 * len(sums))
    for row in products:
        a, b = (int(part) for part in row["input"].removeprefix("What is ").split("?")[0].split(" * "))
        assert row["label"] == str(a * b) and 11 <= a <= 99 and 11 <= b <= 99
    assert all(row in sums for row in mixed if row not in products)
    held_out = {row["input"] for row in map(json.loads, data["eval"].read_text().splitlines())}
    assert not held_out & {row["input"] for row in mixed}
