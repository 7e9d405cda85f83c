"""The learner's memory recorder on CUDA (slime's --record-memory-history): only a GPU machine has what it records;
preflight refuses it elsewhere (tests/actors/test_preflight.py)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from actors.config.profiling import ProfilingConfig
from actors.learner.profiling import StepProfiler


@pytest.mark.gpu
def test_memory_history_is_written_as_a_cuda_snapshot_after_the_asked_steps(tmp_path: Path) -> None:
    """slime's --record-memory-history with --memory-snapshot-num-steps 2: CUDA's allocator history from the rank's
    start, written after step 1 (rollout ids from 0) and not before; pytorch.org/memory_viz reads the pickle."""
    profiler = StepProfiler(ProfilingConfig(record_memory_history=True, memory_snapshot_num_steps=2), tmp_path, 0)
    for rollout_id in (0, 1, 2):
        with profiler.step(rollout_id):
            block = torch.ones(1024, 1024, device="cuda")  # 4 MiB
            del block
        if rollout_id == 0:
            assert list(tmp_path.iterdir()) == []
    [snapshot] = list(tmp_path.iterdir())
    assert snapshot.name == "memory_snapshot_rank0_snapshot.pickle"
    history = pickle.loads(snapshot.read_bytes())
    allocations = [event for trace in history["device_traces"] for event in trace if event["action"] == "alloc"]
    assert sum(event["size"] >= 4 * 1024 * 1024 for event in allocations) == 2  # one block in each recorded step
    profiler.close()  # recording already stopped: nothing more is written
    assert list(tmp_path.iterdir()) == [snapshot]
