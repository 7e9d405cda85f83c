"""Profiling a learner rank as slime does: torch.profiler traces of a window of steps, and a memory recorder.

A step is one rollout batch, named by its 0-based rollout id (slime's `rollout_id`: batch_id - 1), so a resumed run
profiles the same steps as the run it resumes. Each rank writes its own files:

- `{target}_rollout{id:06d}_rank{R}.pt.trace.json.gz`: a chrome trace (chrome://tracing, Perfetto, TensorBoard's
  profiler plugin) of one step's `train_overall` (the whole step on this rank), or of its `train_actor` part (the
  optimizer steps) or `train_log_probs` part (the log-prob forwards), `_{k}` numbering the k-th such part of the
  step. Inside a `train_overall` trace the parts are labelled by `record_function`, not traced apart (torch runs
  one profiler per thread).
- `memory_snapshot_rank{R}_{--memory-snapshot-path}`: CUDA's allocator history since the rank started (torch's
  recorder; open it in pytorch.org/memory_viz), written after step `--memory-snapshot-num-steps - 1` and on a CUDA
  out-of-memory error; or a memray capture file (`--memory-recorder memray`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from actors.config.profiling import ProfilingConfig

logger = logging.getLogger(__name__)

OVERALL = "train_overall"


def profile_directory(config: ProfilingConfig, run_dir: Path) -> Path:
    return Path(config.profile_dir).expanduser() if config.profile_dir else run_dir / "profile"


class StepProfiler:
    """Wraps a rank's steps (`step`) and their parts (`part`); does nothing outside the asked window."""

    def __init__(self, config: ProfilingConfig, directory: Path, rank: int) -> None:
        self.config = config
        self.directory = directory
        self.rank = rank
        self.rollout_id: int | None = None
        self.parts: dict[str, int] = {}  # target -> parts traced in the current step
        self.memory = MemoryRecorder.create(config, directory, rank) if config.record_memory_history else None
        if self.memory is not None:
            self.memory.start()

    @classmethod
    def for_run(cls, config: ProfilingConfig, directory: Path) -> StepProfiler | None:
        """The rank's profiler, or None when the run profiles nothing."""
        if not (config.use_pytorch_profiler or config.record_memory_history):
            return None
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        return cls(config, directory, rank)

    def traces(self, target: str) -> bool:
        config = self.config
        return (config.use_pytorch_profiler and target in config.profile_target and self.rollout_id is not None
                and config.profile_step_start <= self.rollout_id < config.profile_step_end)

    @contextlib.contextmanager
    def step(self, rollout_id: int | None) -> Iterator[None]:
        """One learner step: traced whole when `train_overall` is a target and the step is in the window."""
        self.rollout_id, self.parts = rollout_id, {}
        try:
            if self.traces(OVERALL):
                with self._trace(f"{OVERALL}_rollout{rollout_id:06d}_rank{self.rank}.pt.trace.json.gz"):
                    yield
            else:
                yield
        finally:
            self.rollout_id = None
        steps = self.config.memory_snapshot_num_steps
        if self.memory is not None and steps is not None and rollout_id == steps - 1:
            self.memory.stop()

    @contextlib.contextmanager
    def part(self, target: str) -> Iterator[None]:
        """A part of the step (`train_actor`, `train_log_probs`): labelled inside the step's trace, or traced on
        its own when the step is not traced whole."""
        with torch.profiler.record_function(target):
            if self.traces(target) and not self.traces(OVERALL):
                index = self.parts[target] = self.parts.get(target, 0) + 1
                with self._trace(f"{target}_rollout{self.rollout_id:06d}_rank{self.rank}_{index}.pt.trace.json.gz"):
                    yield
            else:
                yield

    @contextlib.contextmanager
    def _trace(self, name: str) -> Iterator[None]:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profile = torch.profiler.profile(activities=activities, record_shapes=True, with_stack=True,
                                         profile_memory=True, with_flops=True)
        with profile:
            yield
        self.directory.mkdir(parents=True, exist_ok=True)
        profile.export_chrome_trace(str(self.directory / name))
        logger.info("profiler trace written: %s", self.directory / name)

    def close(self) -> None:
        if self.memory is not None:
            self.memory.stop()


def step_part(profiler: StepProfiler | None, target: str) -> contextlib.AbstractContextManager[Any]:
    """`profiler.part(target)`, or nothing when the run profiles nothing."""
    return profiler.part(target) if profiler is not None else contextlib.nullcontext()


class MemoryRecorder:
    """slime's memory profiler: recording starts with the rank and stops (writing its file) once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.recording = False

    @staticmethod
    def create(config: ProfilingConfig, directory: Path, rank: int) -> MemoryRecorder:
        folder = Path(config.memory_snapshot_dir).expanduser() if config.memory_snapshot_dir else directory
        path = folder / f"memory_snapshot_rank{rank}_{config.memory_snapshot_path}"
        return TorchMemoryRecorder(path) if config.memory_recorder == "torch" else MemrayRecorder(path)

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError


class TorchMemoryRecorder(MemoryRecorder):
    """CUDA's allocator history (`torch.cuda.memory._record_memory_history`), dumped as a snapshot pickle."""

    def start(self) -> None:
        if not torch.cuda.is_available():  # preflight refuses this on a node without a GPU
            raise RuntimeError("--record-memory-history (--memory-recorder torch) records CUDA's allocator, and "
                               "this process sees no GPU")
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="all")
        self.recording = True
        attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
        if attach is not None:
            attach(self._on_out_of_memory)

    def _on_out_of_memory(self, device: int, alloc: int, device_alloc: int, device_free: int) -> None:
        logger.error("CUDA out of memory on device %s (asked %s bytes, %s free): memory snapshot to %s", device,
                     alloc, device_free, self.path)
        self._dump()

    def _dump(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(self.path))

    def stop(self) -> None:
        if not self.recording:
            return
        self._dump()
        torch.cuda.memory._record_memory_history(enabled=None)
        self.recording = False
        logger.info("memory snapshot written: %s", self.path)


class MemrayRecorder(MemoryRecorder):
    """A memray capture of the rank's host allocations (native stacks too)."""

    def start(self) -> None:
        import memray  # preflight refuses the recorder where the package is missing

        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)  # memray refuses to overwrite
        self.tracker = memray.Tracker(file_name=str(self.path), native_traces=True)
        self.tracker.__enter__()
        self.recording = True

    def stop(self) -> None:
        if not self.recording:
            return
        self.tracker.__exit__(None, None, None)
        self.recording = False
        logger.info("memray capture written: %s", self.path)
