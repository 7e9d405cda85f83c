"""Soak benchmark (issue #17): one long fully-async run of 64 simulated rollout workers; no stall, no memory growth.

    python -m tools.chaos.soak                         # 64 rollout workers, 10 minutes
    python -m tools.chaos.soak --quick                 # 16 workers, 2 minutes: the smoke run
    python -m tools.chaos.soak --minutes 30 --workers 32 --json soak.json

The run is a real one through launcher.py, as in tools/bench/pipeline.py (whose launch it reuses): the real
controller, buffer, reward workers, rollout workers and learner, each in its own process, on the bus; only the
compute sleeps (tools/sim/pipeline.py), which lets 64 workers fit on a 2-core machine. The run asks for far more
steps than it can train in the soak, so it never ends by itself; the soak ends it with SIGTERM to the launcher.

The soak's minutes count from when the controller reports the run "running" (every actor registered): start-up
of 70 processes on a loaded machine takes from seconds to a minute or more, and is not what a soak is about.
Every SAMPLE_SECONDS it samples each actor's resident memory (VmRSS from /proc/PID/status; pids from the
launcher's "actor process started" records, the latest per actor), the launcher's and its actor template's,
the steps trained (metrics/train.jsonl) and restarts (started records beyond the first per actor).

One table, each figure against its target; the baseline, measured in the same run, is the end of the warm-up:
- memory: RSS per role at the end of the warm-up and at the end, growth < 10% (rollout workers: the median
  worker, and the worker that grew most);
- throughput: steps/s in the first and last thirds after the warm-up; the last >= 0.8x the first;
- stall: the longest time without a trained step (the open gap at the end included) under the stall threshold;
- restarts: 0; and the launcher stops within its deadline when told to, killing no actor for ignoring SIGTERM
  and leaving none behind.
Exit status 1 when any figure misses its target.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tools.bench.pipeline import (
    NUM_ROLLOUT,
    STOPPED_BY_US,
    Launch,
    PipelineShape,
    Scenario,
    json_safe,
    write_prompts,
)
from tools.bench.pipeline_measure import running_since
from tools.run_watch import RunWatch, Sample, resident_kib
from tools.sim.pipeline import SimSpec

GROWTH_TARGET = 0.10  # issue #17: resident memory may grow less than 10% over the soak
# Warm-up: allocators, msgpack and ZeroMQ buffers, the groups in flight and the batches kept until a checkpoint
# fill during start-up and the first batches. Measured: the buffer's RSS rises for its first 60-90 steps (~60 s at
# the default costs; 71 -> 106 MiB with 64 workers) and is flat after, while BufferCore alone holds at most 13 MiB
# of live objects over 400 steps (so the rise is the allocator settling, not a leak). Hence a minute, or 10% of a
# longer soak; a short one keeps at least half of its minutes as the measured window.
WARMUP_FRACTION = 0.10
WARMUP_MIN_S = 60.0
# No slowdown: the last third's steps/s at least this share of the first third's. The machine is shared, and
# other work moves a run's rate by 10-20% from one minute to the next; a slowdown from something that grows
# with the run (a scan over all groups, a list that is never trimmed) compounds, and falls well below this.
SLOWDOWN_FLOOR = 0.8
# A stall: no trained step for more than 10x the median step gap, and more than STALL_MIN_S. 10x is far beyond
# a step's ordinary variation (a batch waits for its slowest, truncated group: ~1-2x the median); the absolute
# floor keeps a few seconds of the scheduler's hiccups with 70 processes on a shared 2-core machine from counting.
STALL_FACTOR = 10.0
STALL_MIN_S = 10.0
# A long run checkpoints, and the soak's does too: the buffer keeps every served batch until a learner checkpoint
# covers it (exactly-once replay after a learner restart, actors/buffer/core.py), so a run that never checkpoints
# grows the buffer by one batch per step by design (measured: +1.3 MiB a step at these costs, +78% in a minute;
# `--save-interval 0` shows it). Every 20 steps (~15 s at the default costs) keeps that retention small beside
# the buffer's base, with a few whole cycles inside the warm-up.
SAVE_INTERVAL = 20
SAMPLE_SECONDS = 5.0
PROGRESS_SECONDS = 30.0
STOP_DEADLINE_S = 120.0  # SIGTERM -> the launcher's exit: drain, leave, SIGKILL after its own grace (15 s)
LEFTOVER_DEADLINE_S = 10.0  # after the launcher exited, its actors must be gone within this


@dataclass(frozen=True)
class SoakOptions:
    """What to soak: the workers, the minutes, the costs and batch shape of bench_pipeline's async mode."""

    workers: int = 64
    duration_s: float = 600.0  # from when the run is "running"
    sample_s: float = SAMPLE_SECONDS
    shape: PipelineShape = field(default_factory=PipelineShape)
    spec: SimSpec = field(default_factory=SimSpec)
    save_interval: int | None = SAVE_INTERVAL  # learner checkpoints every N steps; None: never
    extra_flags: tuple[str, ...] = ()  # more launcher flags

    def launcher_flags(self) -> tuple[str, ...]:
        return (("--save-interval", str(self.save_interval)) if self.save_interval else ()) + self.extra_flags

    @property
    def warmup_s(self) -> float:
        return min(max(WARMUP_FRACTION * self.duration_s, WARMUP_MIN_S), self.duration_s / 2.0)

    @property
    def startup_deadline_s(self) -> float:
        """Launch -> "running": every process starting on a loaded machine (bench_pipeline allows the same)."""
        return 120.0 + 2.0 * self.workers

    def bound_steps_per_s(self) -> float:
        """The analytic bound: the slower of the rollout stage and the trainer, in batches per second."""
        samples_per_s = min(self.spec.rollout_capacity(self.workers, self.shape.n_samples),
                            self.spec.trainer_capacity())
        return samples_per_s / self.shape.samples_per_batch

    def num_rollout(self) -> int:
        """Steps the run is allowed: 10x what the bound allows over start-up and the soak, so it never ends first."""
        reachable = self.bound_steps_per_s() * (self.startup_deadline_s + self.duration_s + STOP_DEADLINE_S)
        if not math.isfinite(reachable):
            raise ValueError("soak: the simulated trainer must cost time (train_sample_seconds > 0) to bound steps")
        return max(NUM_ROLLOUT, 10 * math.ceil(reachable))


# ------------------------------------------------------------------------------------------ the soak
@dataclass
class RoleMemory:
    """Resident memory of one role (or one statistic over a role's processes) at the warm-up's end and the end."""

    role: str
    processes: int
    warmup_mib: float
    end_mib: float
    growth: float  # (end - warm-up) / warm-up
    who: str = ""  # the process a "max" row is about

    @property
    def ok(self) -> bool:
        return self.growth < GROWTH_TARGET


@dataclass
class SoakResult:
    """Every figure of one soak; `checks` holds them against their targets."""

    workers: int
    duration_s: float
    warmup_s: float
    sample_s: float
    startup_s: float  # launch -> "running"
    bound_steps_per_s: float
    memory: list[RoleMemory]
    steps_total: int  # trained by the end of the soak
    steps_at_warmup: int
    rate_first: float  # steps/s, first third after the warm-up
    rate_last: float  # steps/s, last third
    longest_gap_s: float  # longest time without a trained step, the open gap at the end included
    median_gap_s: float
    restarts: dict[str, int]
    stop_s: float  # SIGTERM -> the launcher exited
    exit_code: int | None
    leftover: list[str]  # actors whose process outlived the launcher's exit by LEFTOVER_DEADLINE_S
    killed_at_stop: list[str]  # actors the launcher SIGKILLed: they did not exit within its grace after SIGTERM
    load_mean: float
    load_max: float
    run_dir: str
    timeline: list[dict[str, Any]] = field(default_factory=list)  # per sample: t, steps, MiB per role, load

    @property
    def stall_threshold_s(self) -> float:
        return max(STALL_FACTOR * self.median_gap_s, STALL_MIN_S)

    def checks(self) -> dict[str, bool]:
        """Every target of the soak: name -> met."""
        checks = {f"memory: {m.role}": m.ok for m in self.memory}
        checks["throughput: no slowdown"] = self.rate_last >= SLOWDOWN_FLOOR * self.rate_first > 0
        checks["no stall"] = self.steps_total > 1 and self.longest_gap_s <= self.stall_threshold_s
        checks["no restarts"] = not self.restarts
        checks["clean stop"] = (self.stop_s <= STOP_DEADLINE_S and self.exit_code in STOPPED_BY_US
                                and not self.leftover and not self.killed_at_stop)
        return checks

    @property
    def passed(self) -> bool:
        return all(self.checks().values())


def run_soak(options: SoakOptions, work_dir: Path, progress: Callable[[str], None] | None = None) -> SoakResult:
    """Launch the run, sample it for `options.duration_s` once it is running, stop it, and measure."""
    run_dir = work_dir / f"soak-w{options.workers}"
    run_dir.mkdir(parents=True, exist_ok=True)
    prompts = write_prompts(work_dir / "prompts.jsonl")
    scenario = Scenario("async", options.workers, options.shape.async_staleness, options.spec)
    launch = Launch(scenario, options.shape, run_dir, prompts, num_rollout=options.num_rollout(),
                    extra_flags=options.launcher_flags())
    watch = RunWatch(run_dir, launch.process.pid)
    try:
        running = _wait_until_running(launch, options.startup_deadline_s)
        startup_s = time.monotonic() - launch.started
        samples = _sample(launch, watch, running, options, progress)
    except BaseException:
        launch.stop()
        raise
    stopped = _stop_and_reap(launch, watch)
    watch.update()  # the launcher's last records: which actors it had to kill
    return _measure(options, watch, running, samples, startup_s, stopped)


def _wait_until_running(launch: Launch, deadline_s: float) -> float:
    """Wall time at which the controller declared the run "running"; raises if the launcher ends or is late."""
    deadline = launch.started + deadline_s
    while (running := running_since(launch.run_dir)) is None:
        _raise_if_ended(launch, "before it was running")
        if time.monotonic() > deadline:
            raise TimeoutError(f"soak run in {launch.run_dir} was not running {deadline_s:.0f}s after launch; "
                               "see its launcher_output.txt and logs/")
        time.sleep(0.5)
    return running


def _raise_if_ended(launch: Launch, when: str) -> None:
    if launch.process.poll() is not None:
        tail = (launch.run_dir / "launcher_output.txt").read_text(encoding="utf-8", errors="replace")[-3000:]
        raise RuntimeError(f"soak run in {launch.run_dir}: the launcher exited with {launch.process.returncode} "
                           f"{when}:\n{tail}")


def _sample(launch: Launch, watch: RunWatch, running: float, options: SoakOptions,
            progress: Callable[[str], None] | None) -> list[Sample]:
    """A sample every `sample_s` until `duration_s` after "running" (the last one exactly at the end)."""
    end = running + options.duration_s
    samples: list[Sample] = []
    next_progress = running + PROGRESS_SECONDS
    while True:
        _raise_if_ended(launch, "during the soak (it must run until the soak stops it)")
        now = time.time()
        samples.append(watch.sample(now - running))
        if progress is not None and (now >= next_progress or now >= end):
            next_progress += PROGRESS_SECONDS
            last = samples[-1]
            progress(f"  {last.t:6.0f}s/{options.duration_s:.0f}s  steps {last.steps:6d}  RSS total "
                     f"{sum(last.rss_kib.values()) / 1024:8.0f} MiB  restarts {sum(watch.restarts().values())}  "
                     f"load {last.load:5.1f}")
        if now >= end:
            return samples
        time.sleep(max(0.0, min(options.sample_s, end - time.time())))


@dataclass(frozen=True)
class Stopped:
    seconds: float  # SIGTERM -> the launcher exited
    exit_code: int | None
    leftover: list[str]  # actors still alive LEFTOVER_DEADLINE_S after the launcher exited


def _stop_and_reap(launch: Launch, watch: RunWatch) -> Stopped:
    """SIGTERM to the launcher; it must exit within STOP_DEADLINE_S (else it is killed, and the stop fails), and
    its actors must be gone within LEFTOVER_DEADLINE_S after."""
    watch.update()
    actors = dict(watch.pids)
    stopped = time.monotonic()
    launch.process.send_signal(signal.SIGTERM)
    try:
        launch.process.wait(timeout=STOP_DEADLINE_S)
    except subprocess.TimeoutExpired:
        launch.stop()
    stop_s = time.monotonic() - stopped
    deadline = time.monotonic() + LEFTOVER_DEADLINE_S
    while (alive := [a for a, pid in actors.items() if resident_kib(pid) is not None]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return Stopped(stop_s, launch.process.returncode, alive)


# ------------------------------------------------------------------------------------------ measuring
def _measure(options: SoakOptions, watch: RunWatch, running: float, samples: list[Sample], startup_s: float,
             stopped: Stopped) -> SoakResult:
    warmup = next((s for s in samples if s.t >= options.warmup_s), samples[-1])
    end = samples[-1]
    end_wall = running + end.t
    walls = [w for w in watch.step_walls if w <= end_wall]
    gaps = [b - a for a, b in itertools.pairwise(walls)]
    if walls:
        gaps.append(end_wall - walls[-1])  # the open gap: a run that stopped training stalls to the very end
    third = (end.t - warmup.t) / 3.0
    loads = [s.load for s in samples]
    return SoakResult(
        workers=options.workers, duration_s=end.t, warmup_s=warmup.t, sample_s=options.sample_s, startup_s=startup_s,
        bound_steps_per_s=options.bound_steps_per_s(), memory=memory_by_role(warmup, end),
        steps_total=len(walls), steps_at_warmup=warmup.steps,
        rate_first=_rate(walls, running + warmup.t, running + warmup.t + third),
        rate_last=_rate(walls, end_wall - third, end_wall),
        longest_gap_s=max(gaps, default=math.inf), median_gap_s=statistics.median(gaps) if gaps else math.inf,
        restarts=watch.restarts(), stop_s=stopped.seconds, exit_code=stopped.exit_code, leftover=stopped.leftover,
        killed_at_stop=list(watch.killed),
        load_mean=statistics.fmean(loads), load_max=max(loads), run_dir=str(watch.run_dir),
        timeline=[{"t": s.t, "steps": s.steps, "load": s.load, "mib": _mib_by_role(s)} for s in samples],
    )


def _rate(walls: list[float], start: float, end: float) -> float:
    return sum(start < w <= end for w in walls) / (end - start) if end > start else math.nan


def _role(who: str) -> str:
    return who.split("-", 1)[0]


def _mib_by_role(sample: Sample) -> dict[str, float]:
    totals: dict[str, float] = {}
    for who, kib in sample.rss_kib.items():
        totals[_role(who)] = totals.get(_role(who), 0.0) + kib / 1024
    return totals


def memory_by_role(warmup: Sample, end: Sample) -> list[RoleMemory]:
    """Per role, over the processes alive in both samples under the same pid (a restarted actor is a new process,
    and counts as a restart): singletons as they are, reward workers summed, rollout workers as the median worker
    and the worker that grew most; the launcher, its actor template, and everything summed."""
    same = [w for w in warmup.rss_kib if w in end.rss_kib and warmup.pids.get(w) == end.pids.get(w)]

    def row(role: str, members: list[str], who: str = "") -> RoleMemory:
        before = sum(warmup.rss_kib[m] for m in members) / 1024
        after = sum(end.rss_kib[m] for m in members) / 1024
        return RoleMemory(role, len(members), before, after, (after - before) / before if before else math.nan, who)

    rows = [row(role, [w for w in same if w == role]) for role in ("controller", "buffer", "learner")]
    reward = [w for w in same if _role(w) == "reward"]
    rows.append(row(f"reward (sum of {len(reward)})", reward))
    rollout = [row(w, [w], who=w) for w in same if _role(w) == "rollout"]
    if rollout:
        rows.append(RoleMemory(f"rollout (median of {len(rollout)})", len(rollout),
                               statistics.median(r.warmup_mib for r in rollout),
                               statistics.median(r.end_mib for r in rollout),
                               statistics.median(r.growth for r in rollout)))
        worst = max(rollout, key=lambda r: r.growth)
        rows.append(RoleMemory("rollout (max growth)", 1, worst.warmup_mib, worst.end_mib, worst.growth, worst.who))
    rows += [row(role, [role]) for role in ("launcher", "template") if role in same]
    rows.append(row("total", same))
    return [r for r in rows if r.processes]


# ------------------------------------------------------------------------------------------ reporting
def _pct(value: float) -> str:
    return f"{100 * value:+.1f}%" if math.isfinite(value) else "-"


def soak_table(result: SoakResult) -> str:
    """One table: each figure at the end of the warm-up (the baseline) and at the end, against its target."""
    verdict = {True: "PASS", False: "FAIL"}
    checks = result.checks()
    header = f"{'':<31} {'warm-up':>10} {'end':>10} {'change':>9}  {'target':<20} {'':>4}"
    lines = [
        f"soak: {result.workers} rollout workers, {result.duration_s:.0f}s after the run was running (start-up "
        f"{result.startup_s:.0f}s); warm-up {result.warmup_s:.0f}s; a sample every {result.sample_s:g}s; "
        f"load average {result.load_mean:.1f} (max {result.load_max:.1f}) on {os.cpu_count()} cores; RSS is VmRSS "
        "per process (pages shared with the actor template count in each)",
        header, "-" * len(header),
    ]
    for m in result.memory:
        name = f"RSS MiB {m.role}"
        lines.append(f"{name:<31} {m.warmup_mib:10.1f} {m.end_mib:10.1f} {_pct(m.growth):>9}  "
                     f"{f'< +{100 * GROWTH_TARGET:.0f}%':<20} {verdict[m.ok]}" + (f"  ({m.who})" if m.who else ""))
    ratio = result.rate_last / result.rate_first if result.rate_first > 0 else math.nan
    lines += [
        f"{'steps trained':<31} {result.steps_at_warmup:10d} {result.steps_total:10d} {'':>9}  "
        f"{f'bound {result.bound_steps_per_s:.2f}/s':<20}",
        f"{'steps/s first / last third':<31} {result.rate_first:10.2f} {result.rate_last:10.2f} {ratio:8.2f}x  "
        f"{f'>= {SLOWDOWN_FLOOR:g}x':<20} {verdict[checks['throughput: no slowdown']]}",
        f"{'longest step gap s':<31} {'':>10} {result.longest_gap_s:10.2f} {'':>9}  "
        f"{f'<= {result.stall_threshold_s:.1f}':<20} {verdict[checks['no stall']]}  (median gap "
        f"{result.median_gap_s:.2f}s)",
        f"{'restarts':<31} {'':>10} {sum(result.restarts.values()):10d} {'':>9}  {'0':<20} "
        f"{verdict[checks['no restarts']]}" + (f"  ({', '.join(sorted(result.restarts))})" if result.restarts else ""),
        f"{'stop: SIGTERM -> exit s':<31} {'':>10} {result.stop_s:10.1f} {'':>9}  "
        f"{f'<= {STOP_DEADLINE_S:.0f}, none killed':<20} "
        f"{verdict[checks['clean stop']]}  ({_stop_note(result)})",
    ]
    kept = f"; run directory {result.run_dir}" if Path(result.run_dir).exists() else ""
    lines.append(f"soak {'PASSED' if result.passed else 'FAILED'}{kept}")
    return "\n".join(lines)


def _stop_note(result: SoakResult) -> str:
    notes = [f"launcher exit {result.exit_code}"]
    if result.killed_at_stop:
        notes.append(f"killed after ignoring SIGTERM: {', '.join(result.killed_at_stop)}")
    if result.leftover:
        notes.append(f"left running: {', '.join(result.leftover)}")
    return "; ".join(notes)


def to_json(result: SoakResult) -> dict[str, Any]:
    figures = asdict(result)
    figures.update(stall_threshold_s=result.stall_threshold_s, checks=result.checks(), passed=result.passed,
                   targets={"growth": GROWTH_TARGET, "slowdown_floor": SLOWDOWN_FLOOR, "stall_factor": STALL_FACTOR,
                            "stall_min_s": STALL_MIN_S}, cpu_count=os.cpu_count())
    return json_safe(figures)


# ------------------------------------------------------------------------------------------------ CLI
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 16 workers for 2 minutes (the first is the warm-up the buffer needs)")
    parser.add_argument("--workers", type=int, default=None, help="rollout workers (default 64, --quick 16)")
    parser.add_argument("--minutes", type=float, default=None,
                        help="soak length after the run is running (default 10, --quick 2)")
    parser.add_argument("--sample-seconds", type=float, default=SAMPLE_SECONDS, help="sampling interval")
    parser.add_argument("--reward-workers", type=int, default=PipelineShape().reward_workers)
    parser.add_argument("--save-interval", type=int, default=SAVE_INTERVAL,
                        help="learner checkpoint every N steps; 0: never (the buffer then keeps every batch)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures to this path")
    parser.add_argument("--keep-run", type=Path, default=None, help="keep the run directory under this path")
    args = parser.parse_args(argv)
    if args.workers is not None and args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if args.minutes is not None and args.minutes <= 0:
        parser.error(f"--minutes must be > 0, got {args.minutes}")
    if not 0 < args.sample_seconds <= 60:
        parser.error(f"--sample-seconds must be in (0, 60], got {args.sample_seconds}")
    if args.save_interval < 0:
        parser.error(f"--save-interval must be >= 0, got {args.save_interval}")
    if args.reward_workers < 1:
        parser.error(f"--reward-workers must be >= 1, got {args.reward_workers}")
    return args


def configure(args: argparse.Namespace) -> SoakOptions:
    minutes = args.minutes if args.minutes is not None else (2.0 if args.quick else 10.0)
    return SoakOptions(workers=args.workers or (16 if args.quick else 64), duration_s=60.0 * minutes,
                       sample_s=args.sample_seconds, shape=PipelineShape(reward_workers=args.reward_workers),
                       save_interval=args.save_interval or None)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    options = configure(args)
    print(f"soak: {options.workers} rollout workers for {options.duration_s:.0f}s once running (start-up "
          f"deadline {options.startup_deadline_s:.0f}s), --num-rollout {options.num_rollout()}", file=sys.stderr,
          flush=True)
    with contextlib.ExitStack() as stack:
        if args.keep_run is not None:
            args.keep_run.mkdir(parents=True, exist_ok=True)
            work_dir = args.keep_run
        else:
            work_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="soak-")))
        result = run_soak(options, work_dir, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(soak_table(result))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(to_json(result), indent=2, allow_nan=False), encoding="utf-8")
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
