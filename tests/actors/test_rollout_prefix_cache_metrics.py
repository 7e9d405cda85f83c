"""A rollout worker on the torch engine reports its prefix cache where its other counters go: in its heartbeats, which
the controller writes to metrics/actors.jsonl."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.runtime.metrics import read_metrics
from tests.support.inprocess import GroupRecorder, actor_system, write_prompts

ROLES = {"controller": "controller", "buffer": "buffer", "reward": GroupRecorder, "rollout": "rollout"}


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_the_workers_heartbeats_carry_what_its_prefix_cache_reused(tmp_path: Path,
                                                                        tiny_model_path: Path) -> None:
    """Every prompt starts with the chat template's head and "What is ": groups that reach the engine in different
    steps take that from the cache."""
    settings = {"hf_checkpoint": str(tiny_model_path), "prompt_data": str(write_prompts(tmp_path / "prompts.jsonl")),
                "rollout_batch_size": 2, "n_samples_per_prompt": 2, "rollout_max_batch_size": 2,
                "rollout_max_response_len": 8, "train_backend": "tools.sim.pipeline:sleeping_trainer",
                "weight_transport": "tools.sim.pipeline:VERSION_ONLY", "use_tensorboard": False, "plots": False}
    async with actor_system(tmp_path, settings, ROLES) as system:
        worker, recorder = system["rollout-0-0"], system["reward-0-0"]
        await system.wait_for(lambda: len(recorder.groups) >= 4, 60, "four generated groups")
        counters = worker.metrics()
        await system.wait_for(lambda: _written_reuse(tmp_path) > 0, 30, "the controller's record of the reuse")
    assert counters["engine.prefix_cache.lookups"] >= 4
    assert counters["engine.prefix_cache.reused_tokens"] > 0
    assert 0 < counters["engine.prefix_cache.hit_rate"] < 1


def _written_reuse(run_dir: Path) -> float:
    """The worker's reused tokens as metrics/actors.jsonl last says (0 before the controller wrote any)."""
    records = read_metrics(run_dir / "metrics" / "actors.jsonl")  # a line being written is skipped
    return max((record.get("rollout-0-0/engine.prefix_cache.reused_tokens", 0) for record in records), default=0)
