"""--seed decides every engine call's sampling seed through the group it serves, never through the worker."""

from __future__ import annotations

import pytest

from actors.config import build_config
from actors.rollout.generate import RolloutContext
from bus.schema import PromptGroup
from tools.sim.pipeline import SimSpec, SleepingEngine, SleepingTokenizer


def group(group_id: str) -> PromptGroup:
    return PromptGroup(group_id=group_id, prompt="1+1=", label="2", metadata={}, n_samples=2, data_index=0)


def context(seed: int, worker: str) -> RolloutContext:
    return RolloutContext(engine=SleepingEngine(SimSpec(), seed=[0]), tokenizer=SleepingTokenizer(),
                          config=build_config({"seed": seed}), worker_id=worker)


@pytest.mark.unit
def test_seeds_follow_the_run_seed_the_group_and_the_call_not_the_worker() -> None:
    first, elsewhere = context(7, "rollout-0-0"), context(7, "rollout-1-3")
    calls = [first.sampling_params(group("0:4")).seed for _ in range(3)]
    assert calls == [elsewhere.sampling_params(group("0:4")).seed for _ in range(3)]  # any worker, same draws
    assert len(set(calls)) == 3  # a multi-turn generate's turns do not reuse one stream
    assert context(7, "w").sampling_params(group("0:5")).seed not in calls
    assert context(8, "w").sampling_params(group("0:4")).seed != calls[0]
    assert all(0 <= seed < 2**63 for seed in calls)
