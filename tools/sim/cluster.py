"""A cluster simulator: synchronous against fully-async RL on clusters this machine cannot hold, in seconds.

    python -m tools.sim.cluster                        # the published comparisons (docs/experiments.md)
    python -m tools.sim.cluster --gpus 1024 --model-b 32 --recommend
    python -m tools.sim.cluster --json out.json

Discrete-event time. The staleness rules are the buffer's own: a group may start only while fewer than
`(v + eta + 1) * B` groups have started (`policies.staleness.AdmissionController`), and a finished group that
slipped past the bound (groups finish out of start order) is evicted at batch assembly and its slot given back.
The rest are cost models:

* An inference engine (`gpus_per_engine` GPUs) decodes its running sequences together. Decoding is memory-bound:
  one step reads the weights once and each sequence's KV cache, so a step takes `t0 * (1 + k / k_half)` for `k`
  sequences, `t0` = the weights' bytes over the engine's memory bandwidth. Every running sequence gets one token
  per step (processor sharing); an engine runs at most `max_running` sequences.
* Response lengths are heavy-tailed: log-normal around `median_len`, clipped at `max_len` (truncation).
* Training costs `6 * params` FLOPs per token at `mfu` of the GPUs' peak.
* A weight update costs `weight_bytes / sync_gb_s + sync_latency_s`, during which the engines do not decode.

Synchronous (the baseline, as in verl's or slime's colocated mode): every GPU generates the batch, then every GPU
trains on it, then the weights move. Fully async: `rollout_gpus` generate without stopping, the other GPUs train
whenever a batch is ready, and the staleness bound holds generation back when it runs too far ahead. Both see the
same batches of the same length distribution (one seed), so the ratio of their step times is the speedup.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from policies.staleness import AdmissionController, staleness_of_range

BYTES_PER_PARAM = 2  # bfloat16 weights


@dataclass(frozen=True)
class ClusterSpec:
    """A cluster, a model and an RL workload; the defaults are an H100 cluster."""

    gpus: int = 128
    rollout_gpus: int = 96  # fully async: GPUs that generate; the rest train
    gpus_per_engine: int = 1
    model_b: float = 7.0  # parameters, billions
    prompts_per_step: int = 512  # B groups per training batch
    samples_per_prompt: int = 16
    median_len: int = 4000  # response tokens
    len_sigma: float = 1.0  # log-normal spread: 1.0 puts the 95th percentile at ~5x the median
    max_len: int = 27000
    prompt_len: int = 300
    hbm_tb_s: float = 3.35  # memory bandwidth per GPU
    decode_efficiency: float = 0.6  # of the bandwidth a decode step achieves
    k_half: int = 64  # sequences at which reading KV caches costs as much as reading the weights
    max_running: int = 256  # sequences one engine decodes at once
    peak_tflops: float = 989.0  # bf16 dense
    mfu: float = 0.35
    sync_gb_s: float = 40.0  # weight-update bandwidth
    sync_latency_s: float = 2.0
    max_staleness: int = 4
    steps: int = 12
    seed: int = 0

    @property
    def train_gpus(self) -> int:
        return self.gpus - self.rollout_gpus

    def step_time_s(self, gpus_per_engine: int) -> float:
        """t0: one decode step of one sequence, the weights read once from the engine's GPUs."""
        bandwidth = self.hbm_tb_s * 1e12 * self.decode_efficiency * gpus_per_engine
        return self.model_b * 1e9 * BYTES_PER_PARAM / bandwidth

    def train_seconds(self, tokens: float, gpus: int) -> float:
        return 6 * self.model_b * 1e9 * tokens / (gpus * self.peak_tflops * 1e12 * self.mfu)

    def sync_seconds(self) -> float:
        return self.model_b * 1e9 * BYTES_PER_PARAM / (self.sync_gb_s * 1e9) + self.sync_latency_s

    def check(self) -> None:
        if not 0 < self.rollout_gpus < self.gpus:
            raise ValueError(f"rollout_gpus {self.rollout_gpus}: must leave GPUs to train on (0 < r < {self.gpus})")
        if self.rollout_gpus % self.gpus_per_engine or self.gpus % self.gpus_per_engine:
            raise ValueError(f"gpus_per_engine {self.gpus_per_engine} must divide the rollout GPUs and all GPUs")


@dataclass(frozen=True)
class SimResult:
    mode: str
    step_s: float  # mean wall time per training step, after the first (warm-up) steps
    engine_busy: float  # fraction of engine time spent decoding
    trainer_busy: float
    mean_staleness: float
    max_staleness: int
    evicted: float = 0.0  # fraction of generated groups the consumption check dropped as too stale


def response_lengths(spec: ClusterSpec, groups: int, rng: np.random.Generator) -> np.ndarray:
    lengths = rng.lognormal(math.log(spec.median_len), spec.len_sigma, size=(groups, spec.samples_per_prompt))
    return np.clip(np.rint(lengths), 16, spec.max_len).astype(np.int64)


class Engine:
    """One inference engine under processor sharing: every running sequence gets one token per decode step.

    Progress is counted in tokens per running sequence since the engine started, so a sequence that starts at
    progress p with n tokens to go finishes when progress reaches p + n, whatever happens to the rate meanwhile;
    only the rate (one step per `step_s`) changes when sequences start or finish."""

    def __init__(self, index: int, t0: float, k_half: int, capacity: int) -> None:
        self.index, self.t0, self.k_half, self.capacity = index, t0, k_half, capacity
        self.progress = 0.0
        self.updated = 0.0  # wall time `progress` is current at (later than now during a weight-update pause)
        self.finishing: list[tuple[float, int]] = []  # (progress at which a sample finishes, its group)
        self.busy_s = 0.0
        self.stamp = 0  # bumped whenever the next finish time changes: older heap entries are stale

    @property
    def running(self) -> int:
        return len(self.finishing)

    def step_s(self) -> float:
        return self.t0 * (1 + self.running / self.k_half)

    def catch_up(self, now: float) -> None:
        if now > self.updated:
            if self.finishing:
                self.progress += (now - self.updated) / self.step_s()
                self.busy_s += now - self.updated
            self.updated = now

    def add(self, group: int, lengths: np.ndarray, now: float) -> None:
        self.catch_up(now)
        for length in lengths:
            heapq.heappush(self.finishing, (self.progress + float(length), group))

    def pop_finished(self, now: float) -> list[int]:
        """Groups' samples finished by `now`, one entry per sample."""
        self.catch_up(now)
        done = []
        while self.finishing and self.finishing[0][0] <= self.progress + 1e-6:
            done.append(heapq.heappop(self.finishing)[1])
        return done

    def next_finish(self) -> float:
        if not self.finishing:
            return math.inf
        return self.updated + max(0.0, self.finishing[0][0] - self.progress) * self.step_s()


class EnginePool:
    """The engines and a heap of their next finish times (entries go stale when an engine's rate changes)."""

    def __init__(self, spec: ClusterSpec, engines: int) -> None:
        t0 = spec.step_time_s(spec.gpus_per_engine)
        self.engines = [Engine(i, t0, spec.k_half, spec.max_running) for i in range(engines)]
        self.heap: list[tuple[float, int, int]] = []
        self.samples_left: dict[int, int] = {}

    def schedule(self, engine: Engine) -> None:
        engine.stamp += 1
        heapq.heappush(self.heap, (engine.next_finish(), engine.index, engine.stamp))

    def start(self, group: int, lengths: np.ndarray, now: float, room: int) -> bool:
        """Put `group` on the least-loaded engine with room for it; False if none has."""
        engine = min(self.engines, key=lambda e: e.running)
        if engine.running + len(lengths) > room:
            return False
        engine.add(group, lengths, now)
        self.samples_left[group] = len(lengths)
        self.schedule(engine)
        return True

    def next_time(self) -> float:
        while self.heap:
            when, index, stamp = self.heap[0]
            if stamp == self.engines[index].stamp:
                return when
            heapq.heappop(self.heap)
        return math.inf

    def finish_next(self) -> tuple[float, list[int]]:
        """Advance to the next finish; returns its time and the groups all of whose samples are now done."""
        self.next_time()  # drop stale entries first
        when, index, _ = heapq.heappop(self.heap)
        engine = self.engines[index]
        done = []
        for group in engine.pop_finished(when):
            self.samples_left[group] -= 1
            if self.samples_left[group] == 0:
                del self.samples_left[group]
                done.append(group)
        self.schedule(engine)
        return when, done

    def pause(self, now: float, until: float) -> None:
        """A weight update: no engine decodes between `now` and `until`."""
        for engine in self.engines:
            engine.catch_up(now)
            engine.updated = max(engine.updated, until)
            self.schedule(engine)

    @property
    def busy_s(self) -> float:
        return sum(engine.busy_s for engine in self.engines)


def simulate_sync(spec: ClusterSpec) -> SimResult:
    """Every GPU generates the batch, every GPU trains on it, then the weights move."""
    rng = np.random.default_rng(spec.seed)
    engines = spec.gpus // spec.gpus_per_engine
    steps, busy = [], 0.0
    for _ in range(spec.steps):
        lengths = response_lengths(spec, spec.prompts_per_step, rng)
        pool = EnginePool(spec, engines)
        waiting, clock = list(range(spec.prompts_per_step)), 0.0
        while waiting or pool.samples_left:
            while waiting and pool.start(waiting[0], lengths[waiting[0]], clock, spec.max_running):
                waiting.pop(0)
            clock, _ = pool.finish_next()
        tokens = float(lengths.sum() + spec.prompt_len * lengths.size)
        steps.append(clock + spec.train_seconds(tokens, spec.gpus) + spec.sync_seconds())
        busy += pool.busy_s / engines
    return SimResult("synchronous", float(np.mean(steps[1:])), busy / sum(steps), 1 - busy / sum(steps), 0.0, 0)


def simulate_async(spec: ClusterSpec) -> SimResult:
    """Rollout engines generate without stopping, held back only by the admission rule; the trainer steps whenever
    B groups are ready; each new version pauses the engines for the weight update."""
    spec.check()
    rng = np.random.default_rng(spec.seed)
    groups_needed = spec.prompts_per_step * (spec.steps + spec.max_staleness + 2)
    lengths = response_lengths(spec, groups_needed, rng)
    admission = AdmissionController(spec.max_staleness, spec.prompts_per_step)
    pool = EnginePool(spec, spec.rollout_gpus // spec.gpus_per_engine)
    version, started, dropped, clock = 0, 0, 0, 0.0
    started_at: dict[int, int] = {}  # group -> learner version when it started
    ready: list[int] = []  # scored groups, in the order they finished
    training_until, trainer_busy = math.inf, 0.0
    step_ends: list[float] = []
    staleness: list[int] = []
    while len(step_ends) < spec.steps:
        while (started < groups_needed
               and admission.may_start(learner_version=version, started_groups=started, dropped_groups=dropped)
               and pool.start(started, lengths[started], clock, spec.max_running)):
            started_at[started] = version
            started += 1
        if training_until == math.inf:
            # the buffer's consumption check: a group that finished late and slipped past the bound is evicted,
            # and its slot goes back to the admission budget
            fresh = [g for g in ready if staleness_of_range(version, (started_at[g],) * 2) <= spec.max_staleness]
            dropped += len(ready) - len(fresh)
            ready = fresh
        if training_until == math.inf and len(ready) >= spec.prompts_per_step:
            batch, ready = ready[:spec.prompts_per_step], ready[spec.prompts_per_step:]
            staleness += [version - started_at[group] for group in batch]
            tokens = float(sum(lengths[group].sum() for group in batch)
                           + spec.prompt_len * spec.samples_per_prompt * len(batch))
            seconds = spec.train_seconds(tokens, spec.train_gpus)
            trainer_busy += seconds
            training_until = clock + seconds
        finish = pool.next_time()
        if min(finish, training_until) == math.inf:
            raise RuntimeError("the simulation stalled: nothing generates and the trainer waits (check the spec)")
        if finish <= training_until:
            clock, done = pool.finish_next()
            ready += done
        else:
            clock, training_until = training_until, math.inf
            version += 1
            step_ends.append(clock)
            pool.pause(clock, clock + spec.sync_seconds())  # the engines load the new weights
    warm = step_ends[1:]
    step_s = (warm[-1] - warm[0]) / (len(warm) - 1) if len(warm) > 1 else step_ends[-1]
    return SimResult(f"async eta={spec.max_staleness}", float(step_s), pool.busy_s / (len(pool.engines) * clock),
                     trainer_busy / clock, float(np.mean(staleness)), int(max(staleness)), dropped / max(started, 1))


def speedup(spec: ClusterSpec) -> tuple[SimResult, SimResult, float]:
    sync, fully_async = simulate_sync(spec), simulate_async(spec)
    return sync, fully_async, sync.step_s / fully_async.step_s


def recommend(spec: ClusterSpec, etas: tuple[int, ...] = (1, 2, 4, 8)) -> tuple[ClusterSpec, SimResult]:
    """The fastest rollout/trainer split and the smallest staleness bound within 3% of the fastest step."""
    unit = spec.gpus_per_engine
    splits = sorted({max(unit, min(spec.gpus - unit, round(spec.gpus * f / unit) * unit))
                     for f in (0.5, 0.625, 0.75, 0.8125, 0.875, 0.9375)})
    trials = []
    for eta in etas:
        for rollout in splits:
            candidate = replace(spec, rollout_gpus=rollout, max_staleness=eta)
            trials.append((candidate, simulate_async(candidate)))
    best = min(result.step_s for _, result in trials)
    good = [(c, r) for c, r in trials if r.step_s <= 1.03 * best]
    return min(good, key=lambda trial: (trial[0].max_staleness, trial[1].step_s))


# Published comparisons, in their stated settings (docs/experiments.md says where each number comes from).
PUBLISHED: dict[str, tuple[ClusterSpec, str]] = {
    "AReaL, 1.5B, 16 nodes": (ClusterSpec(gpus=128, rollout_gpus=96, model_b=1.5, prompts_per_step=512,
                                          samples_per_prompt=16, median_len=6000, max_len=27000,
                                          max_staleness=4), "up to 2.77x (AReaL, arXiv 2505.24298)"),
    "AReaL, 7B, 24 nodes": (ClusterSpec(gpus=192, rollout_gpus=144, model_b=7.0, prompts_per_step=512,
                                        samples_per_prompt=16, median_len=6000, max_len=27000,
                                        max_staleness=4), "up to 2.77x (AReaL, arXiv 2505.24298)"),
    "verl fully_async, 7B, 128 GPUs": (ClusterSpec(gpus=128, rollout_gpus=96, model_b=7.0, prompts_per_step=512,
                                                   samples_per_prompt=16, median_len=4000, max_len=28000,
                                                   max_staleness=1), "2.35-2.67x (verl fully_async_policy)"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=None, help="simulate this cluster instead of the published ones")
    parser.add_argument("--model-b", type=float, default=7.0, help="model size, billions of parameters")
    parser.add_argument("--rollout-gpus", type=int, default=None, help="default: 3/4 of the GPUs")
    parser.add_argument("--max-staleness", type=int, default=4)
    parser.add_argument("--prompts-per-step", type=int, default=512)
    parser.add_argument("--samples-per-prompt", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--recommend", action="store_true",
                        help="also search the rollout/trainer split and the staleness bound (always for the "
                             "published cases)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.gpus is None:
        cases = {name: spec for name, (spec, _) in PUBLISHED.items()}
    else:
        rollout = args.rollout_gpus or args.gpus * 3 // 4
        cases = {f"{args.gpus} GPUs, {args.model_b:g}B": ClusterSpec(
            gpus=args.gpus, rollout_gpus=rollout, model_b=args.model_b, max_staleness=args.max_staleness,
            steps=args.steps, prompts_per_step=args.prompts_per_step, samples_per_prompt=args.samples_per_prompt)}
    rows = []
    header = f"{'case':<32}{'sync s/step':>12}{'async s/step':>13}{'speedup':>9}{'published':>40}"
    print(header)
    print("-" * len(header))
    for name, spec in cases.items():
        sync, fully_async, ratio = speedup(spec)
        published = PUBLISHED.get(name, (spec, "-"))[1]
        print(f"{name:<32}{sync.step_s:>12.0f}{fully_async.step_s:>13.0f}{ratio:>8.2f}x{published:>40}")
        row = {"case": name, "spec": asdict(spec), "sync": asdict(sync), "async": asdict(fully_async),
               "speedup": ratio}
        if args.recommend or args.gpus is None:
            best_spec, best = recommend(spec)
            print(f"  recommended: --max-staleness {best_spec.max_staleness}, {best_spec.rollout_gpus} rollout / "
                  f"{best_spec.train_gpus} training GPUs: {best.step_s:.0f} s/step "
                  f"({sync.step_s / best.step_s:.2f}x over synchronous)")
            row["recommended"] = {"spec": asdict(best_spec), "result": asdict(best)}
        rows.append(row)
    print("baseline: synchronous (every GPU generates, then trains), same workload and seed, measured in this run")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
