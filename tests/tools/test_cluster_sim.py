"""The cluster simulator (tools/sim/cluster.py): its event mechanics against closed forms, the staleness rule it
borrows from the buffer, and the direction of the effects it exists to show."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tools.sim.cluster import ClusterSpec, recommend, simulate_async, simulate_sync

SMALL = ClusterSpec(gpus=16, rollout_gpus=12, model_b=1.0, prompts_per_step=16, samples_per_prompt=4,
                    median_len=500, max_len=4000, steps=8)


@pytest.mark.unit
def test_a_synchronous_step_is_generation_then_training_then_the_weight_update() -> None:
    """Equal lengths on one engine: all sequences run start to end, so generation is len * t0 * (1 + k / k_half)."""
    spec = replace(SMALL, gpus=1, rollout_gpus=0, len_sigma=0.0, prompts_per_step=2, samples_per_prompt=4)
    k = spec.prompts_per_step * spec.samples_per_prompt
    generation = spec.median_len * spec.step_time_s(1) * (1 + k / spec.k_half)
    training = spec.train_seconds(k * (spec.median_len + spec.prompt_len), 1)
    assert simulate_sync(spec).step_s == pytest.approx(generation + training + spec.sync_seconds(), rel=1e-6)


@pytest.mark.unit
def test_the_buffers_admission_rule_bounds_staleness_and_eta_zero_is_on_policy() -> None:
    on_policy = simulate_async(replace(SMALL, max_staleness=0))
    assert on_policy.max_staleness == 0 and on_policy.mean_staleness == 0
    relaxed = simulate_async(replace(SMALL, max_staleness=2))
    assert relaxed.mean_staleness > 0 and relaxed.max_staleness <= 2
    assert relaxed.step_s < on_policy.step_s  # generation overlaps training once it may run ahead


@pytest.mark.unit
def test_long_tails_are_what_asynchrony_wins_back() -> None:
    """A batch that fills the engines: with equal lengths a synchronous step wastes little, with a long tail the
    engines idle while the last sequences finish. Each side at its best split (asynchrony at one bound, 2: the
    search over bounds is the recommendation test's)."""
    full = replace(SMALL, prompts_per_step=128, samples_per_prompt=16)
    gains = []
    for sigma in (0.1, 0.6):
        spec = replace(full, len_sigma=sigma)
        gains.append(simulate_sync(spec).step_s / recommend(spec, etas=(2,))[1].step_s)
    assert gains[1] > gains[0] * 1.2, gains


@pytest.mark.unit
def test_the_recommendation_is_the_smallest_bound_within_three_percent_of_the_fastest_split() -> None:
    chosen, result = recommend(SMALL, etas=(1, 4))
    every = [simulate_async(replace(SMALL, rollout_gpus=rollout, max_staleness=eta))
             for eta in (1, 4) for rollout in (8, 10, 12, 13, 14, 15)]
    assert result.step_s <= 1.03 * min(trial.step_s for trial in every)
    assert chosen.max_staleness in (1, 4) and 0 < chosen.rollout_gpus < SMALL.gpus


@pytest.mark.unit
def test_a_spec_without_training_gpus_is_refused() -> None:
    with pytest.raises(ValueError, match="must leave GPUs to train on"):
        simulate_async(replace(SMALL, rollout_gpus=16))


@pytest.mark.integration
def test_the_command_prints_its_table_and_writes_its_rows(tmp_path: Path) -> None:
    output = tmp_path / "sim.json"
    done = subprocess.run([sys.executable, "-m", "tools.sim.cluster", "--gpus", "8", "--model-b", "1",
                           "--steps", "3", "--prompts-per-step", "32",
                           "--samples-per-prompt", "4", "--recommend", "--json", str(output)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "speedup" in done.stdout and "recommended: --max-staleness" in done.stdout
    (row,) = json.loads(output.read_text())
    assert row["speedup"] == pytest.approx(row["sync"]["step_s"] / row["async"]["step_s"])
