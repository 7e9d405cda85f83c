"""Where the learner's batches come from and what training them means, as small strategies picked once.

Sources: the buffer (the normal run), recorded batches (`--load-debug-rollout-data`: a directory of ours, or
slime's rollout dumps), and a recorder around either (`--save-debug-rollout-data`). Trainings: the real one, and
`--debug-rollout-only`'s, which trains nothing and only counts versions so the rest of the run (evaluation rounds,
staleness) moves on. The learner's loop is the same whatever was picked; the debug modes live here and nowhere else.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import msgspec

from actors.config import RunConfig
from actors.extensions.load import recorded_batch_reader
from actors.extensions.points import BatchReader
from actors.learner.ranks import CollectiveTrainer
from actors.learner.step import PreparedBatch, StepReport, TrainingStep
from bus.codec import decode, encode
from bus.schema import BATCH_ORDER, Batch, BatchRequest, Error, FinalCommit


@dataclass(frozen=True)
class Progress:
    """What the learner tells its source: its version, the last batch trained, the last batch checkpointed."""

    learner_version: int
    trained_batch: int
    checkpointed_batch: int


class BatchSource(Protocol):
    async def next(self, progress: Progress, *, ahead: bool = False) -> Batch | None:
        """The batch after `progress.trained_batch`, or None to ask again later. `ahead`: asked while that batch
        still trains (a prefetch), see `BatchRequest.ahead`."""

    async def finish(self, progress: Progress) -> None:
        """After the last batch and its checkpoint: make the end durable at the source."""


class BatchRefused(RuntimeError):
    """The buffer will never serve the batch asked for: the run cannot go on (see BATCH_ORDER)."""


# The buffer answers a batch request within its long-poll (2 s), so an attempt with no answer in 4 s was lost (a
# restarting buffer, a dropped frame) and is sent again then rather than after 10 s; a retry reuses the request id,
# so a late answer is still taken and no batch is served twice. Unanswered after 20 s in all, and a buffer that is
# restarting waited for 10 s, as before.
BATCH_ATTEMPT_S, BATCH_RETRIES, BUFFER_WAIT_S = 4.0, 4, 10.0


class BufferSource:
    """The buffer actor, over RPC. A buffer that does not answer is restarting: count it and ask again."""

    def __init__(self, buffer: Any, counters: Counter[str], log: Any) -> None:
        self.buffer = buffer
        self.counters = counters
        self.log = log

    async def next(self, progress: Progress, *, ahead: bool = False) -> Batch | None:
        request = BatchRequest(learner_version=progress.learner_version, trained_batch=progress.trained_batch,
                               checkpointed_batch=progress.checkpointed_batch, ahead=ahead)
        try:
            reply = await self.buffer.call(request, timeout=BATCH_ATTEMPT_S, retries=BATCH_RETRIES,
                                           member_wait=BUFFER_WAIT_S)
        except (TimeoutError, asyncio.TimeoutError, ConnectionError):
            self.counters["batch.unanswered"] += 1
            return None
        if isinstance(reply, Error) and reply.reason == BATCH_ORDER:
            raise BatchRefused(f"the buffer cannot serve batch {progress.trained_batch + 1}: {reply.detail}")
        if not isinstance(reply, Batch) or not reply.samples:
            return None
        return reply

    async def finish(self, progress: Progress) -> None:
        """Commit the last batches in the buffer's log (the checkpoint just written covers them)."""
        commit = FinalCommit(learner_version=progress.learner_version, trained_batch=progress.trained_batch,
                             checkpointed_batch=progress.checkpointed_batch)
        try:
            await self.buffer.call(commit, timeout=5.0, retries=1)
        except Exception as error:
            self.log.warning("final commit to the buffer failed", error=repr(error))


class RecordedBatches:
    """`--load-debug-rollout-data`: batch N is `batch_{N:06d}.msgpack` in the directory; a gap is an error. Or
    another framework's rollout dumps, batch N read at the learner's version by `read` (slime's, see
    `actors.extensions.load.recorded_batch_reader`). `subsample` (`--load-debug-rollout-data-subsample`): train on
    that fraction of each batch (`subsampled`)."""

    def __init__(self, directory: Path, subsample: float | None = None, *,
                 read: BatchReader | None = None) -> None:
        self.directory = directory
        self.subsample = subsample
        self.read = read

    async def next(self, progress: Progress, *, ahead: bool = False) -> Batch | None:
        batch_id = progress.trained_batch + 1
        if self.read is not None:
            batch = await asyncio.to_thread(self.read, batch_id, progress.learner_version)
            return batch if self.subsample is None else subsampled(batch, self.subsample)
        path = self.directory / f"batch_{batch_id:06d}.msgpack"
        if not path.exists():
            raise FileNotFoundError(f"--load-debug-rollout-data: {path} missing (batch {batch_id})")
        batch = decode(path.read_bytes())
        if not isinstance(batch, Batch):
            raise ValueError(f"{path}: expected a Batch, found {type(batch).__name__}")
        return batch if self.subsample is None else subsampled(batch, self.subsample)

    async def finish(self, progress: Progress) -> None:
        """Nothing to commit: the recording is read-only."""


def subsampled(batch: Batch, fraction: float) -> Batch:
    """slime's subsample of a replayed batch: of `int(n x fraction)` kept (at least one), the first half from
    the batch's start and the rest from its end; counted in whole groups here, so every group's advantages still
    have their whole group (slime cuts samples)."""
    groups = list(dict.fromkeys(sample.group_id for sample in batch.samples))
    keep = max(1, int(len(groups) * fraction))
    kept = set(groups[: keep // 2] + groups[len(groups) - (keep - keep // 2):])
    chosen = [i for i, sample in enumerate(batch.samples) if sample.group_id in kept]
    return msgspec.structs.replace(batch, samples=[batch.samples[i] for i in chosen],
                                   staleness=[batch.staleness[i] for i in chosen] if batch.staleness else [])


class Recording:
    """`--save-debug-rollout-data`: every batch the inner source yields is also written, for a later replay."""

    def __init__(self, inner: BatchSource, directory: Path) -> None:
        self.inner = inner
        self.directory = directory

    async def next(self, progress: Progress, *, ahead: bool = False) -> Batch | None:
        batch = await self.inner.next(progress, ahead=ahead)
        if batch is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            (self.directory / f"batch_{batch.batch_id:06d}.msgpack").write_bytes(encode(batch))
        return batch

    async def finish(self, progress: Progress) -> None:
        await self.inner.finish(progress)


class Training(Protocol):
    """`keeps_model`: the run's result is the model (final checkpoint and export); `publishes`: engines get it."""

    keeps_model: bool
    publishes: bool

    @property
    def version(self) -> int: ...

    async def prepare(self, batch: Batch) -> PreparedBatch | None:
        """What of the batch's step can run before the step in hand ends (None: nothing, all of it waits)."""

    async def train(self, batch: Batch, prepared: PreparedBatch | None = None) -> StepReport | None: ...


class RealTraining:
    """The batch's optimizer steps (one, or `--num-steps-per-rollout`) on every learner rank; the version moves
    once per batch either way. With `--debug-train-only` no engine runs, so no weights are published."""

    keeps_model = True

    def __init__(self, trainer: CollectiveTrainer, step: TrainingStep, *, publishes: bool) -> None:
        self.trainer = trainer
        self.step = step
        self.publishes = publishes

    @property
    def version(self) -> int:
        return self.trainer.version

    async def prepare(self, batch: Batch) -> PreparedBatch | None:
        """The reference forward and the conversions of the next batch, on their own thread beside the current
        step, where the trainer allows it (one rank: its followers would need the prepared batch too)."""
        if (self.trainer.ranks.world > 1 or not self.trainer.local.prepares_beside_training
                or self.step.refreshes_reference or self.step.profiler is not None):
            return None
        return await asyncio.to_thread(self.step.prepare, batch.samples, batch.staleness)

    async def train(self, batch: Batch, prepared: PreparedBatch | None = None) -> StepReport | None:
        return await asyncio.to_thread(self.trainer.train, self.step, batch, prepared)


class CountingOnly:
    """`--debug-rollout-only`: no training; each batch bumps the version so the run proceeds as if trained (a
    version is one rollout batch whatever the optimizer steps per batch, as for `RealTraining`)."""

    keeps_model = False
    publishes = False

    def __init__(self) -> None:
        self._version = 0

    @property
    def version(self) -> int:
        return self._version

    async def prepare(self, batch: Batch) -> PreparedBatch | None:
        return None

    async def train(self, batch: Batch, prepared: PreparedBatch | None = None) -> StepReport | None:
        self._version += 1
        return None


def pick_source(config: RunConfig, buffer: Any, counters: Counter[str], log: Any) -> BatchSource:
    source: BatchSource
    if config.learner.load_debug_rollout_data:
        source = RecordedBatches(Path(config.learner.load_debug_rollout_data),
                                 subsample=config.learner.load_debug_rollout_data_subsample,
                                 read=recorded_batch_reader(config))
    else:
        source = BufferSource(buffer, counters, log)
    if config.learner.save_debug_rollout_data:
        source = Recording(source, Path(config.learner.save_debug_rollout_data))
    return source


def pick_training(config: RunConfig, trainer: CollectiveTrainer, step: TrainingStep) -> Training:
    if config.learner.debug_rollout_only:
        return CountingOnly()
    return RealTraining(trainer, step, publishes=not config.learner.debug_train_only)
