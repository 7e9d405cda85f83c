"""Synthetic compute for the pipeline benchmark: a rollout worker and a learner that cost time, not CPU.

`tools/bench_pipeline.py` runs the real orchestration (launcher, controller, buffer, reward workers, the bus)
with these two actors standing in for the engines, so what it measures is the orchestration itself:

- `SyntheticRollout` speaks the real rollout worker's protocol (credit-based `LeaseRequest` -> `Lease`, one
  `GeneratedGroup` per group to the reward role) with the same lease loop as `actors/rollout.py`. Its engine
  "decodes" by `asyncio.sleep`: simulated accelerator time per token, so 64 workers fit on 2 CPU cores. The
  n samples of a group decode together, so a group takes as long as its longest sample; response lengths are
  heavy-tailed (a log-normal clipped to [min, max], the clip standing in for truncation at max length).
- `SyntheticLearner` speaks the real learner's protocol (long-poll `BatchRequest` -> `Batch`, a
  `VersionAnnouncement` to the controller after each step) and "trains" by sleeping per sample. It pushes no
  weights: weight transfer is free here, so the synthetic engines run the newest version the moment it exists.
  An engine learns of it from the version broadcast or from a lease stamped with a newer version, whichever
  arrives first, and tags every token with the version in force when the token was produced, so the buffer's
  admission and staleness checks work exactly as in a real run.

Neither class imports torch or transformers (64 processes each importing torch would need ~20 GB). Their costs
come from `RUN_DIR/pipeline_sim.json` (`SimSpec`), written by the benchmark before it launches the run: the
launcher hands actors only the run configuration, and the run directory is the one other thing every actor
knows. Both actors start work only once the controller reports the run "running" (every expected actor
registered), so start-up is not part of what they record: the learner its steps in
`RUN_DIR/metrics/sim_learner_steps.jsonl`, each worker when its engine was busy in `sim_rollout_busy-<id>.jsonl`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import zlib
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from actors.base import Actor
from actors.config import RunConfig
from actors.handlers import on_broadcast
from actors.metrics import read_metrics
from bus.schema import (
    TOPIC_RUN_STATE,
    TOPIC_VERSION,
    Batch,
    BatchRequest,
    Control,
    GeneratedGroup,
    Lease,
    LeaseRequest,
    PromptGroup,
    RunState,
    Sample,
    VersionAnnouncement,
)

SPEC_FILE = "pipeline_sim.json"
STEPS_FILE = "sim_learner_steps.jsonl"
BUSY_FILE = "sim_rollout_busy-{actor_id}.jsonl"  # one line per generated group: when its engine slot was busy
CHARS_PER_TOKEN = 4  # response text is as long as a real one, so messages weigh what real ones weigh
VOCAB_SIZE = 32_000


@dataclass(frozen=True)
class SimSpec:
    """The synthetic costs and the learner's stopping rule; one file shared by every synthetic actor."""

    token_seconds: float = 0.75e-3  # simulated decode time per token of one sequence (a group decodes together)
    train_sample_seconds: float = 5e-3  # simulated training time per sample
    groups_per_worker: int = 1  # groups one engine decodes at once (its batch is this x n_samples sequences)
    length_median: float = 128.0  # response length distribution: log-normal, clipped to [length_min, length_max]
    length_sigma: float = 1.0
    length_min: int = 16
    length_max: int = 1024
    prompt_tokens: int = 64
    correct_fraction: float = 0.5  # share of responses whose boxed answer matches the label
    lease_retry_seconds: float = 0.05  # an idle worker asks again after an empty lease (0.05 in actors/rollout.py)
    warmup_batches: int = 2  # the learner's first batches, excluded from the steady-state window
    measure_seconds: float = 20.0  # the learner stops once the window is this long ...
    min_measured_batches: int = 3  # ... and holds at least this many batches (num_rollout caps both)
    seed: int = 0

    def __post_init__(self) -> None:
        problems = []
        for name in ("token_seconds", "train_sample_seconds", "measure_seconds", "lease_retry_seconds"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("groups_per_worker", "length_min", "min_measured_batches"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.length_max < self.length_min:
            problems.append(f"length_max {self.length_max} < length_min {self.length_min}")
        if self.length_median <= 0 or self.length_sigma <= 0:
            problems.append("length_median and length_sigma must be > 0")
        if not 0.0 <= self.correct_fraction <= 1.0:
            problems.append(f"correct_fraction must be in [0, 1], got {self.correct_fraction}")
        if self.warmup_batches < 0 or self.prompt_tokens < 0:
            problems.append("warmup_batches and prompt_tokens must be >= 0")
        if problems:
            raise ValueError("SimSpec: " + "; ".join(problems))

    # ------------------------------------------------------------------------------------- persistence
    def write(self, run_dir: Path) -> Path:
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / SPEC_FILE
        path.write_text(json.dumps(asdict(self), indent=2), encoding="utf-8")
        return path

    @classmethod
    def read(cls, run_dir: Path) -> SimSpec:
        path = run_dir / SPEC_FILE
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ValueError(f"{path}: missing; the pipeline benchmark writes it before launching the run") from None
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not valid JSON ({error})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"{path}: unknown key(s) {', '.join(unknown)}")
        return cls(**data)

    # -------------------------------------------------------------------------------------- analytics
    def length_distribution(self) -> tuple[np.ndarray, np.ndarray]:
        """Support and probabilities of the clipped, discretised log-normal: lengths below the minimum count as
        the minimum, lengths above the maximum as the maximum (a response truncated at max length)."""
        lengths = np.arange(self.length_min, self.length_max + 1)
        edges = np.log(np.append(lengths - 0.5, lengths[-1] + 0.5) / self.length_median) / self.length_sigma
        cdf = np.array([0.5 * (1.0 + math.erf(z / math.sqrt(2.0))) for z in edges])
        cdf[0], cdf[-1] = 0.0, 1.0
        return lengths, np.diff(cdf)

    def mean_length(self) -> float:
        lengths, probabilities = self.length_distribution()
        return float(lengths @ probabilities)

    def mean_group_seconds(self, n_samples: int) -> float:
        """E[longest of n independent lengths] x per-token time: E[max] = sum over k of P(max > k)."""
        lengths, probabilities = self.length_distribution()
        cdf = np.cumsum(probabilities)
        below = float(lengths[0])  # P(max >= k) = 1 for every k up to the minimum length
        tail = float(np.sum(1.0 - np.clip(cdf[:-1], 0.0, 1.0) ** n_samples))
        return (below + tail) * self.token_seconds

    def rollout_capacity(self, workers: int, n_samples: int) -> float:
        """Samples/s the rollout stage can produce: workers x concurrent groups x n / mean group time."""
        group_seconds = self.mean_group_seconds(n_samples)
        return math.inf if group_seconds == 0 else workers * self.groups_per_worker * n_samples / group_seconds

    def trainer_capacity(self) -> float:
        """Samples/s the trainer can consume: 1 / per-sample cost."""
        return math.inf if self.train_sample_seconds == 0 else 1.0 / self.train_sample_seconds


class LengthSampler:
    """Draws response lengths from the spec's distribution with a generator of its own (one per worker)."""

    def __init__(self, spec: SimSpec, seed: int | list[int]) -> None:
        self.lengths, probabilities = spec.length_distribution()
        self.cdf = np.cumsum(probabilities)
        self.rng = np.random.default_rng(seed)

    def draw(self, count: int) -> np.ndarray:
        picks = np.searchsorted(self.cdf, self.rng.random(count), side="right")
        return self.lengths[np.minimum(picks, len(self.lengths) - 1)]


class SyntheticEngine:
    """Decodes by sleeping. Keeps the times at which new policy versions became available, so that every
    token is tagged with the version in force when it was produced (a version can land mid-generation)."""

    def __init__(self, spec: SimSpec, *, seed: list[int]) -> None:
        self.spec = spec
        self.lengths = LengthSampler(spec, seed)
        self.rng = np.random.default_rng([*seed, 1])
        self._since: list[float] = [-math.inf]  # monotonic time from which _versions[i] was in force
        self._versions: list[int] = [0]

    @property
    def version(self) -> int:
        return self._versions[-1]

    def observe_version(self, version: int) -> None:
        if version > self._versions[-1]:
            self._since.append(time.monotonic())
            self._versions.append(version)

    async def generate(self, group: PromptGroup) -> list[Sample]:
        lengths = self.lengths.draw(group.n_samples)
        started = time.monotonic()
        await asyncio.sleep(float(lengths.max()) * self.spec.token_seconds)
        since, versions = np.asarray(self._since), np.asarray(self._versions, dtype=np.int32)
        token_times = started + self.spec.token_seconds * np.arange(1, int(lengths.max()) + 1)
        token_versions = versions[np.searchsorted(since, token_times, side="right") - 1]
        return [self._sample(group, index, int(length), token_versions[:length])
                for index, length in enumerate(lengths)]

    def _sample(self, group: PromptGroup, index: int, length: int, token_versions: np.ndarray) -> Sample:
        correct = self.rng.random() < self.spec.correct_fraction
        answer = str(group.label) if correct else f"not {group.label}"
        filler = "step " * (length * CHARS_PER_TOKEN // 5)
        return Sample(
            sample_id=f"{group.group_id}/{index}", group_id=group.group_id, index=index, prompt=group.prompt,
            prompt_tokens=self.spec.prompt_tokens,
            tokens=self.rng.integers(0, VOCAB_SIZE, self.spec.prompt_tokens + length, dtype=np.int32),
            response=f"{filler}\\boxed{{{answer}}}", response_length=length, label=group.label,
            loss_mask=np.ones(length, dtype=np.int8),
            rollout_log_probs=-self.rng.exponential(1.0, length).astype(np.float32),
            token_versions=np.ascontiguousarray(token_versions, dtype=np.int32),
            status="truncated" if length >= self.spec.length_max else "completed",
            metadata={**group.metadata, "data_index": group.data_index},
        )


class SyntheticActor(Actor):
    """Starts its work only once the run is "running": every expected actor registered, start-up is over."""

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self._running = asyncio.Event()

    @on_broadcast(TOPIC_RUN_STATE)
    async def on_run_state(self, topic: str, state: RunState) -> None:
        if state.state == "running":
            self._running.set()

    async def wait_until_running(self, poll_seconds: float = 1.0) -> None:
        """Heard by broadcast, and asked by request too: the last actor to register subscribes after the
        "running" broadcast went out. The requests are rare because 64 workers asking often would slow the
        very registrations they wait for."""
        assert self._controller is not None, "call after start(): the actor registers before its story runs"
        while not self.stopping and not self._running.is_set():
            with contextlib.suppress(Exception):  # the controller is busy registering 60 actors; ask again
                reply = await self._controller.call(RunState(state="starting"), timeout=2.0, retries=0)
                if isinstance(reply, RunState) and reply.state == "running":
                    self._running.set()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._running.wait(), poll_seconds)


class SyntheticRollout(SyntheticActor):
    """lease -> generate (sleep) -> send, with the real rollout worker's lease loop and message flow."""

    drain_timeout = 0.5  # nothing in hand is worth waiting for: the run is over when a synthetic worker stops

    async def on_start(self) -> None:
        self.config = RunConfig(**self.settings["run"])
        self.spec = SimSpec.read(self.context.run_dir)
        self.engine = SyntheticEngine(self.spec, seed=[self.spec.seed, zlib.crc32(self.actor_id.encode())])
        self.buffer = self.peer_rpc("buffer")
        self.rewards = self.peer_stream("reward")
        self.capacity = self.spec.groups_per_worker
        self.groups_in_flight = 0
        self._room = asyncio.Condition()
        busy_path = self.context.run_dir / "metrics" / BUSY_FILE.format(actor_id=self.actor_id)
        busy_path.parent.mkdir(parents=True, exist_ok=True)
        self.busy_log = open(busy_path, "a", buffering=1)  # noqa: SIM115 - one line per group, read after the run

    async def run(self) -> None:
        """The loop of `RolloutWorker.run` (actors/rollout.py), minus the real engine's weight wait; the retry
        delay after an empty lease is the spec's, 0.05 s like the real worker unless an experiment changes it."""
        await self.wait_until_running()
        while not self.stopping:
            async with self._room:
                await self._room.wait_for(lambda: self.groups_in_flight < self.capacity)
            lease = await self._request_lease(self.capacity - self.groups_in_flight)
            if lease is None or not lease.groups:
                await asyncio.sleep(self.spec.lease_retry_seconds if lease is not None else 0.5)
                continue
            self.engine.observe_version(lease.version)
            self.groups_in_flight += len(lease.groups)
            for group in lease.groups:
                self.spawn(self._rollout_group(lease, group), name=f"rollout.{group.group_id}")

    async def _rollout_group(self, lease: Lease, group: PromptGroup) -> None:
        try:
            started = time.time()
            samples = await self.engine.generate(group)
            generated = time.time()
            self.counters["samples.generated"] += len(samples)
            self.counters["tokens.generated"] += int(sum(s.response_length for s in samples))
            await self.rewards.send(GeneratedGroup(lease_id=lease.lease_id, group_id=group.group_id,
                                                   samples=samples, worker_id=self.actor_id))
            if not self.busy_log.closed:  # on_stop closes it while the last groups may still be finishing
                self.busy_log.write(json.dumps({"start": started, "end": generated, "sent": time.time()}) + "\n")
        except asyncio.CancelledError:
            raise
        except Exception as error:  # the lease expires and the group is re-issued; say why, do not die
            self.counters["groups.failed"] += 1
            self.log.exception("synthetic rollout of a group failed", group=group.group_id, error=repr(error))
        finally:
            async with self._room:
                self.groups_in_flight -= 1
                self._room.notify_all()

    async def _request_lease(self, max_groups: int) -> Lease | None:
        try:
            reply = await self.buffer.call(LeaseRequest(worker_id=self.actor_id, max_groups=max_groups),
                                           timeout=5.0, retries=2)
        except (TimeoutError, asyncio.TimeoutError):
            self.counters["lease.unanswered"] += 1
            return None
        return reply if isinstance(reply, Lease) else None

    @on_broadcast(TOPIC_VERSION)
    async def on_version(self, topic: str, announcement: VersionAnnouncement) -> None:
        self.engine.observe_version(announcement.version)

    async def on_stop(self) -> None:
        if hasattr(self, "busy_log"):
            self.busy_log.close()


class SyntheticLearner(SyntheticActor):
    """pull -> train (sleep) -> announce, recording every step, until the steady-state window is long enough."""

    drain_timeout = 5.0

    async def on_start(self) -> None:
        self.config = RunConfig(**self.settings["run"])
        self.spec = SimSpec.read(self.context.run_dir)
        self.buffer = self.peer_rpc("buffer")
        self.version = 0
        self.trained_batch = 0
        (self.context.run_dir / "metrics").mkdir(parents=True, exist_ok=True)
        self.steps = open(self.context.run_dir / "metrics" / STEPS_FILE, "a", buffering=1)  # noqa: SIM115
        self.window_started: float | None = None

    async def run(self) -> None:
        """pull -> train -> announce, as `Learner.run` (actors/learner.py) without weights or checkpoints."""
        await self.wait_until_running()
        started = time.time()
        self._record({"event": "start", "wall": started})
        if self.spec.warmup_batches == 0:
            self.window_started = started
        while not self.stopping and not self._done():
            asked = time.time()
            batch = await self.next_batch()
            if batch is None:
                continue
            received = time.time()
            await asyncio.sleep(len(batch.samples) * self.spec.train_sample_seconds)
            trained = time.time()
            self.version += 1
            self.trained_batch = batch.batch_id
            await self.announce_version()
            self._record_step(batch, asked=asked, received=received, trained=trained)
        if self._done():
            await self.finish()

    def _done(self) -> bool:
        if self.trained_batch >= self.config.num_rollout:
            return True
        measured = self.trained_batch - self.spec.warmup_batches
        return (self.window_started is not None and measured >= self.spec.min_measured_batches
                and time.time() - self.window_started >= self.spec.measure_seconds)

    async def next_batch(self) -> Batch | None:
        request = BatchRequest(learner_version=self.version, trained_batch=self.trained_batch,
                               checkpointed_batch=self._checkpointed())
        try:
            reply = await self.buffer.call(request, timeout=10.0, retries=1)
        except (TimeoutError, asyncio.TimeoutError):
            self.counters["batch.unanswered"] += 1
            return None
        if not isinstance(reply, Batch) or not reply.samples:
            return None
        return reply

    def _checkpointed(self) -> int:
        """What a real learner with this run's --save-interval would have made durable (lets the buffer forget)."""
        interval = self.config.save_interval
        return 0 if not interval else (self.trained_batch // interval) * interval

    async def announce_version(self) -> None:
        assert self._controller is not None
        announcement = VersionAnnouncement(version=self.version, weights_version=self.version,
                                           step=self.trained_batch, timestamp=time.time())
        try:
            await self._controller.call(announcement, timeout=2.0, retries=2)
        except Exception as error:  # the next announcement carries the same information
            self.log.warning("version announcement failed", error=repr(error))

    async def finish(self) -> None:
        """Commit what was trained in the buffer, then end the run for everyone, as the real learner does."""
        try:
            await self.buffer.call(BatchRequest(learner_version=self.version, trained_batch=self.trained_batch,
                                                checkpointed_batch=self.trained_batch, commit_only=True),
                                   timeout=5.0, retries=1)
        except Exception as error:
            self.log.warning("final commit to the buffer failed", error=repr(error))
        assert self._controller is not None
        self._record({"event": "finish", "wall": time.time(), "batches": self.trained_batch})
        await self._controller.call(Control(command="stop", reason=f"trained {self.trained_batch} batches"),
                                    timeout=5.0, retries=2)

    def _record_step(self, batch: Batch, *, asked: float, received: float, trained: float) -> None:
        done = time.time()
        if self.trained_batch == self.spec.warmup_batches:
            self.window_started = done
        staleness = np.asarray(batch.staleness or [0])
        self._record({"event": "step", "batch_id": batch.batch_id, "version": self.version,
                      "samples": len(batch.samples), "asked": asked, "received": received, "trained": trained,
                      "done": done, "staleness_max": int(staleness.max()), "staleness_mean": float(staleness.mean())})

    def _record(self, record: dict[str, Any]) -> None:
        self.steps.write(json.dumps(record) + "\n")

    async def on_stop(self) -> None:
        if hasattr(self, "steps"):
            self.steps.close()


def read_steps(run_dir: Path) -> list[dict[str, Any]]:
    """The learner's records of one run, in order."""
    return read_metrics(run_dir / "metrics" / STEPS_FILE)


def read_busy_log(run_dir: Path) -> list[dict[str, float]]:
    """Every group generated by any synthetic rollout worker of the run: wall times `start` and `end` of its
    generation and `sent`, when the reward stream took it (a late `sent` is a back-pressured stream)."""
    records = []
    for path in sorted((run_dir / "metrics").glob(BUSY_FILE.format(actor_id="*"))):
        records += read_metrics(path)
    return records

