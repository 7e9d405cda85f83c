"""`tools/experiments/routing_replay.py`: the learner scores an MoE batch with and without the engine's routes."""

from __future__ import annotations

import re

import pytest

from tools.experiments import routing_replay


@pytest.mark.integration
def test_an_fp32_engine_leaves_no_gap_and_a_bf16_one_a_gap_that_replay_does_not_widen(
        capsys: pytest.CaptureFixture[str]) -> None:
    routing_replay.main(["--prompts", "4", "--samples", "2", "--longest", "12"])
    rows = {match[0]: [float(value) for value in match[1:4]] for match in re.findall(
        r"^(bfloat16|float32)\s+\d+\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)%$", capsys.readouterr().out, re.MULTILINE)}
    assert set(rows) == {"bfloat16", "float32"}
    assert rows["float32"] == [0.0, 0.0, 0.0]  # same weights, same precision: the same routes and log-probs
    own, replayed, _ = rows["bfloat16"]
    assert own > 0 and replayed <= own * 1.25  # replay removes a cause of the gap; bf16 rounding stays
