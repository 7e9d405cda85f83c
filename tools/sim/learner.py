"""The learner's side of the pipeline simulation: a trainer and a weight sender that cost time, not compute.

Kept apart from tools/sim/pipeline.py because these implement torch-typed interfaces (`Trainer`, `WeightSender`)
and so import torch, which only the learner's process may pay for; the rollout side there stays torch-free. The
factories in tools/sim/pipeline.py build these with plain values (no import back, no cycle).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from engines.training.base import Loss, ModelOutputs, ModelRole, StepResult, Trainer, TrainSample, WeightLayout
from engines.weights.base import TransferReport, WeightSender

STATE_FILE = "sleeping_trainer.json"


class SleepingTrainer(Trainer):
    """Trains by sleeping `train_sample_seconds` per sample; everything around a step is the learner's own.

    Each step reports when its simulated compute started and ended (wall clock) and how late the sleep woke
    (`sim/*` metrics, which land in the learner's metrics file), so a reader can split a step into waiting for
    data, computing, and what the learner does after (announce, publish, checkpoint).
    """

    RELEASE_POLL_S = 0.05

    def __init__(self, train_sample_seconds: float, *, hold_at_version: int = 0,
                 release_file: Path | None = None) -> None:
        """`hold_at_version`: the step that would make this version first waits for `release_file` to exist."""
        self.train_sample_seconds = train_sample_seconds
        self.hold_at_version = hold_at_version
        self.release_file = release_file
        self._version = 0

    @property
    def version(self) -> int:
        return self._version

    @property
    def gates_updates(self) -> bool:
        """As the one-rank torch trainer, so the pipeline benchmark measures the push beside the next step."""
        return True

    def compute_log_probs(self, samples: Sequence[TrainSample], *, temperature: float, with_entropy: bool = False,
                          model: ModelRole = "policy") -> ModelOutputs:
        """Zeros, one per response token in sample order: the layout the step expects, at no cost."""
        total = sum(int(s.response_length) for s in samples)
        return ModelOutputs(log_probs=torch.zeros(total), entropy=torch.zeros(total) if with_entropy else None)

    def train_step(self, samples: Sequence[TrainSample], loss: Loss, *, temperature: float,
                   with_entropy: bool = False, ends_batch: bool = True) -> StepResult:
        if ends_batch and self.hold_at_version and self._version + 1 >= self.hold_at_version:
            self._wait_for_release()
        cost = len(samples) * self.train_sample_seconds
        started = time.time()
        time.sleep(cost)
        ended = time.time()
        if self.update_gate is not None:
            self.update_gate()  # as the torch trainer: the version it leaves is the "write" of the weights
        self._version += 1 if ends_batch else 0  # the version counts rollout batches, not optimizer steps
        metrics = {"sim/compute_start": started, "sim/compute_end": ended, "sim/timer_late_s": ended - started - cost,
                   "sequences": float(len(samples))}
        return StepResult(version=self._version, metrics=metrics, grad_norm=0.0)

    def _wait_for_release(self) -> None:
        assert self.release_file is not None  # SimSpec refuses a hold without one
        while not self.release_file.exists():
            time.sleep(self.RELEASE_POLL_S)

    def save_checkpoint(self, directory: str | Path, extra_state: dict[str, Any]) -> None:
        """One small JSON file, replaced atomically, so the learner's checkpoint and resume paths run for real."""
        target = Path(directory)
        target.mkdir(parents=True, exist_ok=True)
        partial = target / f".{STATE_FILE}.partial"
        partial.write_text(json.dumps({"version": self._version, "extra_state": extra_state}), encoding="utf-8")
        os.replace(partial, target / STATE_FILE)

    def load_checkpoint(self, directory: str | Path) -> dict[str, Any]:
        path = Path(directory) / STATE_FILE
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"{path}: not a sleeping trainer's checkpoint ({error})") from None
        self._version = int(state["version"])
        return dict(state.get("extra_state") or {})

    def named_tensors(self, layout: WeightLayout = "model") -> Iterator[tuple[str, Tensor]]:
        yield "sim.version", torch.tensor([float(self._version)])  # no experts: one layout

    def export_hf(self, directory: str | Path) -> None:
        target = Path(directory)
        target.mkdir(parents=True, exist_ok=True)
        (target / "config.json").write_text(json.dumps({"model_type": "sleeping", "version": self._version}),
                                            encoding="utf-8")


@dataclass(frozen=True)
class VersionOnlyGroup:
    """A transfer group of VERSION_ONLY: who receives, and the transport's name the engines resolve it by."""

    transport: str
    receivers: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"transport": self.transport, "receivers": list(self.receivers)}


class VersionOnlySender(WeightSender):
    """Moves no bytes: a "transfer" is the version itself, committed once sent (the learner commits for real only
    after every engine acknowledged the order that carries it)."""

    def __init__(self, transport: str) -> None:
        self.transport = transport
        self._committed: int | None = None
        self._group = VersionOnlyGroup(transport, ())

    @property
    def committed_version(self) -> int | None:
        return self._committed

    def open_group(self, members: Sequence[str]) -> VersionOnlyGroup:
        self._group = VersionOnlyGroup(self.transport, tuple(members[1:]))
        return self._group

    def wait_for_receivers(self, timeout_s: float | None = None) -> None:
        """Nobody to wait for: no connection is made."""

    def send(self, named_tensors: Iterable[tuple[str, Tensor]], version: int, *, dtype: torch.dtype | None = None,
             timeout_s: float | None = None, fingerprint: bool = False) -> TransferReport:
        started = time.monotonic()
        count = sum(1 for _ in named_tensors)
        self._committed = version
        return TransferReport(version=version, receivers=self._group.receivers, num_tensors=count, num_buckets=0,
                              num_bytes=0, seconds=time.monotonic() - started)

    def close(self) -> None:
        """Holds nothing."""
