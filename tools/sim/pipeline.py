"""Sleeping compute behind the real seams, for the pipeline benchmark and the actors' in-process tests.

`tools/bench/pipeline.py` runs a real run through launcher.py: controller, buffer, reward workers, the REAL
`RolloutWorker` and `Learner`, and the bus. Only the compute is simulated, by implementations of the same
interfaces the real engines implement, selected with the ordinary plugin flags:

    --rollout-engine tools.sim.pipeline:sleeping_engine      # SleepingEngine + SleepingTokenizer
    --train-backend tools.sim.pipeline:sleeping_trainer      # SleepingTrainer (tools/sim/learner.py)
    --weight-transport tools.sim.pipeline:VERSION_ONLY       # versions travel, bytes do not

- `SleepingEngine` "decodes" by `asyncio.sleep`: simulated accelerator time per token, so 64 workers fit on 2 CPU
  cores. The n samples of a request decode together, so a request takes as long as its longest sample; response
  lengths are heavy-tailed (a log-normal clipped to [min, max], the clip standing in for truncation at max length).
  Every token carries the version in force when it was produced (a weight update can land mid-generation) and a
  log-prob, as a real engine returns them.
- `SleepingTrainer` sleeps per trained sample and writes small checkpoint files, so the learner's whole loop
  (batch service, announce, weight publish, checkpoint, export) runs for real.
- `VERSION_ONLY` keeps the model "weight transfer is free": its sender moves no bytes and its loader only sets the
  engine's version, so the real publish/acknowledge round trip is what remains of a transfer.

This module never imports torch (a rollout worker imports it to build its engine and to resolve the transport,
and 64 workers each importing torch would need ~20 GB); the torch side lives in tools/sim/learner.py.
Costs come from a `SimSpec` file whose path the benchmark puts in `$SLIPSTREAM_PIPELINE_SIM` before it starts the
launcher (actor processes inherit the environment; an engine factory is given only the config and its id).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import time
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from actors.config import RunConfig
from engines.inference.base import GenerateOutput, GenerateRequest, InferenceEngine, PauseMode
from engines.weights.transport import SenderOptions, WeightTransport

if TYPE_CHECKING:
    from engines.training.base import Trainer
    from engines.weights.base import WeightSender

SPEC_FILE = "pipeline_sim.json"
SPEC_ENV = "SLIPSTREAM_PIPELINE_SIM"  # path of the SimSpec file every sleeping implementation reads
BYTE_TOKENS = 256  # token ids below this are single bytes (prompts, answers); the rest are filler word pieces
PIECES = ("step", " so ", "then", " we ", "add ", "the ", "sum ", "next")  # 4 characters each, like a real token
ARITHMETIC = re.compile(r"What is (\d+) \+ (\d+)\?")


@dataclass(frozen=True)
class SimSpec:
    """The synthetic costs and the benchmark's measuring rule; one file shared by every sleeping implementation."""

    token_seconds: float = 0.75e-3  # simulated decode time per token of one sequence (a request decodes together)
    train_sample_seconds: float = 5e-3  # simulated training time per sample
    groups_per_worker: int = 1  # groups one engine decodes at once (its batch is this x n_samples sequences)
    length_median: float = 128.0  # response length distribution: log-normal, clipped to [length_min, length_max]
    length_sigma: float = 1.0
    length_min: int = 16
    length_max: int = 1024
    correct_fraction: float = 0.5  # share of responses whose boxed answer is right
    warmup_batches: int = 2  # the learner's first batches after start-up, excluded from the steady-state window
    measure_seconds: float = 20.0  # the benchmark stops a run once the window is this long ...
    min_measured_batches: int = 3  # ... and holds at least this many batches
    seed: int = 0
    # The learner's step that makes this version waits until `release_file` exists (0: none waits): a tool that
    # needs the run alive until it is done with it (tools/hostile) keeps it so without padding it with steps.
    hold_at_version: int = 0
    release_file: str = ""

    def __post_init__(self) -> None:
        problems = []
        for name in ("token_seconds", "train_sample_seconds", "measure_seconds"):
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
        if self.warmup_batches < 0:
            problems.append(f"warmup_batches must be >= 0, got {self.warmup_batches}")
        if self.hold_at_version < 0:
            problems.append(f"hold_at_version must be >= 0, got {self.hold_at_version}")
        if self.hold_at_version and not self.release_file:
            problems.append(f"hold_at_version {self.hold_at_version} needs a release_file to wait for")
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
        return cls.read_file(run_dir / SPEC_FILE)

    @classmethod
    def read_file(cls, path: Path) -> SimSpec:
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

    @classmethod
    def from_env(cls) -> SimSpec:
        """The spec of this run: `$SLIPSTREAM_PIPELINE_SIM` names its file."""
        path = os.environ.get(SPEC_ENV)
        if not path:
            raise ValueError(f"${SPEC_ENV} is not set: it must name the SimSpec file of the sleeping engine/trainer "
                             "(tools/bench/pipeline.py sets it before it starts the launcher)")
        return cls.read_file(Path(path))

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
    """Draws response lengths from the spec's distribution with a generator of its own (one per engine)."""

    def __init__(self, spec: SimSpec, seed: int | list[int]) -> None:
        self.lengths, probabilities = spec.length_distribution()
        self.cdf = np.cumsum(probabilities)
        self.rng = np.random.default_rng(seed)

    def draw(self, count: int) -> np.ndarray:
        picks = np.searchsorted(self.cdf, self.rng.random(count), side="right")
        return self.lengths[np.minimum(picks, len(self.lengths) - 1)]


class SleepingTokenizer:
    """Bytes in, bytes (and 4-character filler pieces) out: enough of a tokenizer for the rollout path, so a
    response's text is about as long as a real one and the reward worker's exact-match scoring runs on it."""

    eos_token_id: int | None = None

    def __call__(self, text: str, *, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": list(text.encode("utf-8"))}

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                            tokenize: bool) -> list[int]:
        text = "".join(f"<{m.get('role', 'user')}>{m.get('content', '')}\n" for m in messages)
        return self(text + ("<assistant>" if add_generation_prompt else ""))["input_ids"]

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        text = bytearray()
        for token in token_ids:
            text += bytes([token]) if token < BYTE_TOKENS else PIECES[(token - BYTE_TOKENS) % len(PIECES)].encode()
        return text.decode("utf-8", errors="replace")


class SleepingEngine(InferenceEngine):
    """Decodes by sleeping. Keeps the times at which each weight version came into force, so that every token is
    tagged with the version of the weights "in the engine" when it was produced.

    A pause holds back new requests until `resume`; requests in flight run on (there are no weights to tear).
    Aborting a request ends it at once with the tokens its elapsed time paid for, marked "abort".
    """

    def __init__(self, spec: SimSpec, *, seed: list[int]) -> None:
        self.spec = spec
        self.lengths = LengthSampler(spec, seed)
        self.rng = np.random.default_rng([*seed, 1])
        self._since: list[float] = [-math.inf]  # monotonic time from which _versions[i] was in force
        self._versions: list[int] = [0]
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._aborts: dict[str, asyncio.Event] = {}
        self._closed = False
        self.generated_requests = 0

    @property
    def version(self) -> int:
        return self._versions[-1]

    async def generate(self, request: GenerateRequest) -> list[GenerateOutput]:
        if self._closed:
            raise RuntimeError("SleepingEngine: generate after close")
        if request.request_id in self._aborts:
            raise ValueError(f"request {request.request_id!r} is already in flight")
        await self._resumed.wait()
        params = request.params
        lengths = np.minimum(self.lengths.draw(params.n), params.max_new_tokens)
        longest = int(lengths.max())
        aborted = self._aborts[request.request_id] = asyncio.Event()
        started = time.monotonic()
        try:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(aborted.wait(), longest * self.spec.token_seconds)
        finally:
            self._aborts.pop(request.request_id, None)
        produced = longest
        if aborted.is_set() and self.spec.token_seconds > 0:
            produced = min(longest, int((time.monotonic() - started) / self.spec.token_seconds))
        versions = self._versions_of_tokens(started, produced)
        answer = self._answer(request.input_ids)
        self.generated_requests += 1
        return [self._output(request, index, int(min(length, produced)), versions, answer,
                             aborted=int(length) > produced) for index, length in enumerate(lengths)]

    def _versions_of_tokens(self, started: float, count: int) -> np.ndarray:
        since, versions = np.asarray(self._since), np.asarray(self._versions, dtype=np.int64)
        token_times = started + self.spec.token_seconds * np.arange(1, count + 1)
        return versions[np.searchsorted(since, token_times, side="right") - 1]

    def _answer(self, input_ids: Sequence[int]) -> str | None:
        """The right answer to one of the benchmark's arithmetic prompts (None for any other prompt)."""
        prompt = bytes(t for t in input_ids if t < BYTE_TOKENS).decode("utf-8", errors="replace")
        match = ARITHMETIC.search(prompt)
        return str(int(match.group(1)) + int(match.group(2))) if match else None

    def _output(self, request: GenerateRequest, index: int, length: int, versions: np.ndarray, answer: str | None,
                *, aborted: bool) -> GenerateOutput:
        right = answer is not None and self.rng.random() < self.spec.correct_fraction
        boxed = list(f"\\boxed{{{answer if right else 'unsure'}}}".encode())[:length]
        filler = self.rng.integers(BYTE_TOKENS, BYTE_TOKENS + len(PIECES), length - len(boxed))
        finish = "abort" if aborted else ("length" if length >= request.params.max_new_tokens else "stop")
        return GenerateOutput(
            request_id=request.request_id, output_ids=[*filler.tolist(), *boxed],
            log_probs=(-self.rng.exponential(1.0, length)).tolist(), versions=versions[:length].tolist(),
            finish_reason=finish, sample_index=index, prompt_len=len(request.input_ids),
        )

    async def abort(self, request_id: str | None = None) -> None:
        for rid, event in list(self._aborts.items()):
            if request_id is None or rid == request_id:
                event.set()

    async def pause(self, mode: PauseMode = "keep") -> None:
        self._resumed.clear()
        if mode == "abort":
            await self.abort(None)

    async def resume(self) -> None:
        self._resumed.set()

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        """No weights to copy; from now on tokens carry `version` (an older version never replaces a newer)."""
        for _ in named_tensors:
            pass
        if version > self._versions[-1]:
            self._since.append(time.monotonic())
            self._versions.append(version)

    async def health(self) -> dict[str, object]:
        return {"healthy": not self._closed, "version": self.version, "in_flight": len(self._aborts)}

    async def close(self) -> None:
        await self.abort(None)
        self._closed = True
        self._resumed.set()


# ------------------------------------------------------------------------------------------ weights
class VersionOnlyLoader:
    """The engine side of VERSION_ONLY: an update is the new version number, applied between two decode steps."""

    def __init__(self, engine: InferenceEngine, actor_id: str, log: Any) -> None:
        self.engine = engine
        self.actor_id = actor_id
        self.log = log

    async def apply(self, group: Mapping[str, Any], version: int, timeout_s: float) -> None:
        await self.engine.update_weights([], version)

    def close(self) -> None:
        """Holds nothing."""


def _version_only_sender(options: SenderOptions) -> WeightSender:
    from tools.sim.learner import VersionOnlySender  # the learner's side: torch is there anyway

    return VersionOnlySender(VERSION_ONLY.name)


VERSION_ONLY = WeightTransport(name="tools.sim.pipeline:VERSION_ONLY", make_sender=_version_only_sender,
                               make_loader=VersionOnlyLoader)


# ---------------------------------------------------------------------------------------- factories
def sleeping_engine(config: RunConfig, actor_id: str | None) -> tuple[SleepingEngine, SleepingTokenizer]:
    """`--rollout-engine tools.sim.pipeline:sleeping_engine`: one engine per worker, seeded by its id."""
    spec = SimSpec.from_env()
    seed = [spec.seed, zlib.crc32((actor_id or "").encode())]
    return SleepingEngine(spec, seed=seed), SleepingTokenizer()


sleeping_engine.needs_gpu = False  # type: ignore[attr-defined]  # it sleeps on the CPU: no GPU taken on a GPU node


def sleeping_trainer(config: RunConfig) -> Trainer:
    """`--train-backend tools.sim.pipeline:sleeping_trainer`."""
    from tools.sim.learner import SleepingTrainer

    spec = SimSpec.from_env()
    return SleepingTrainer(spec.train_sample_seconds, hold_at_version=spec.hold_at_version,
                           release_file=Path(spec.release_file) if spec.release_file else None)
