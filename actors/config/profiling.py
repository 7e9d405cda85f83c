"""How a run profiles its learner: slime's torch.profiler window and its memory recorder (Megatron's
`--use-pytorch-profiler`, `--profile-step-start/-end`, `--record-memory-history`, `--memory-snapshot-path`, and
slime's `--profile-target`, `--memory-snapshot-dir`, `--memory-snapshot-num-steps`, `--memory-recorder`).

The settings only; `actors.learner.profiling` runs them on every learner rank. A memory recorder needs what it
records: torch's is CUDA's allocator history, memray a package; preflight refuses either where it cannot exist.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from actors.config.sections import Section

ProfileTarget = Literal["train_overall", "train_actor", "train_log_probs"]  # slime's choices


class ProfilingConfig(Section):
    """Profiling the learner: a torch.profiler trace of chosen steps, and a memory history with snapshots."""

    use_pytorch_profiler: bool = Field(False, description="write a torch.profiler chrome trace of each learner step "
                                       "(0-based rollout id) in [profile_step_start, profile_step_end), per rank and "
                                       "--profile-target, into --profile-dir")
    profile_step_start: int = Field(10, ge=0, description="first profiled learner step (0-based rollout id; "
                                    "Megatron's default)")
    profile_step_end: int = Field(12, ge=1, description="profiling stops before this step (Megatron's default)")
    profile_target: list[ProfileTarget] = Field(
        ["train_overall"], description="what a trace covers: train_overall (the whole learner step), train_actor "
        "(its optimizer steps: forward, backward, update) or train_log_probs (its log-prob forwards: pi_old, "
        "reference, teachers); several give one trace each")
    profile_dir: str | None = Field(None, description="where traces (and memory snapshots, unless "
                                    "--memory-snapshot-dir) go (default: RUN_DIR/profile)")
    record_memory_history: bool = Field(False, description="record the learner's allocations from its start "
                                        "(torch: CUDA's allocator history, which needs a GPU; memray: host memory) "
                                        "and write a snapshot after --memory-snapshot-num-steps steps and on a CUDA "
                                        "out-of-memory error")
    memory_recorder: Literal["torch", "memray"] = Field("torch", description="torch (CUDA allocator history, a "
                                                        "pickle for pytorch.org/memory_viz) or memray (a memray "
                                                        "capture file; needs the memray package)")
    memory_snapshot_num_steps: int | None = Field(None, ge=1, description="write the memory snapshot (and stop "
                                                  "recording) after this many learner steps: after the step whose "
                                                  "rollout id is N - 1")
    memory_snapshot_dir: str | None = Field(None, description="where memory snapshots go (default: --profile-dir)")
    memory_snapshot_path: str = Field("snapshot.pickle", description="the snapshot's file name; each rank writes "
                                      "memory_snapshot_rank{R}_{this name} (slime adds the time, too)")

    @model_validator(mode="after")
    def _window(self) -> ProfilingConfig:
        if self.use_pytorch_profiler and self.profile_step_end <= self.profile_step_start:
            raise ValueError(f"profile_step_end {self.profile_step_end} must be greater than profile_step_start "
                             f"{self.profile_step_start}: the window [start, end) holds no step")
        if not self.profile_target:
            raise ValueError("profile_target: name at least one of train_overall, train_actor, train_log_probs")
        if self.record_memory_history and self.memory_recorder == "memray" and self.memory_snapshot_num_steps is None:
            raise ValueError("memory_recorder memray needs memory_snapshot_num_steps: memray writes its capture "
                             "when recording stops (slime asks the same)")
        return self


def memory_recorder_problem(config: ProfilingConfig) -> str | None:
    """Why this node cannot record the learner's memory as asked (None: it can)."""
    if not config.record_memory_history:
        return None
    if config.memory_recorder == "memray":
        import importlib.util

        if importlib.util.find_spec("memray") is None:
            return ("--record-memory-history with --memory-recorder memray: the memray package is not installed "
                    "on this node (pip install memray)")
        return None
    from engines.devices import visible_gpus

    if not visible_gpus():
        return ("--record-memory-history (--memory-recorder torch): it records CUDA's allocator, and this node has "
                "no GPU (on CPU, --memory-recorder memray records host memory)")
    return None
