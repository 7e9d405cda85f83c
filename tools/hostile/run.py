"""The live run the hostile campaign attacks: launching it, finding its bound sockets and processes, watching them.

The run is a real launcher.py run of the real actors (controller, buffer, reward worker, rollout workers,
learner) with only the compute behind their seams sleeping (tools/sim/pipeline.py), so the whole bus and every
actor's receive loop face the attack while the run trains. Everything is read from what the run writes anyway:
endpoints from the actors' "actor started" and the controller's "controller listening" log events, processes
from the launcher's "actor process started", counters from the heartbeats the controller records in
metrics/actors.jsonl, restarts from the launcher's log, resident memory from /proc.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actors.runtime.metrics import read_metrics
from tools.bench.pipeline import SLEEPING_FLAGS, write_prompts
from tools.repo_env import with_repo_on_path
from tools.run_watch import resident_kib, started_actor_pids
from tools.sim.pipeline import SPEC_ENV, SimSpec

REPO = Path(__file__).resolve().parents[2]

HEARTBEAT_S = 1.0  # the default
GROUPS_PER_BATCH = 4
SAMPLES_PER_GROUP = 4


@dataclass(frozen=True)
class Endpoint:
    """One bound socket of the run: who bound it, which channel it is, and where."""

    actor: str
    channel: str  # "inbox" (stream), "rpc" (request/reply; the controller's head address), "engine" (a rollout
    # worker's engine served to the other workers: request/reply too) or "publish"
    address: str

    @property
    def name(self) -> str:
        return f"{self.actor}/{self.channel}"


@dataclass
class Run:
    """A launched run: its directory, launcher process and the settings the attack must know."""

    run_dir: Path
    process: subprocess.Popen[bytes]
    steps: int
    release_file: Path  # its last step waits for this file: the run stays up until the attack is judged
    started: float = field(default_factory=time.monotonic)

    def release(self) -> None:
        """Let the held last step train, so the run finishes."""
        self.release_file.touch()

    def log_events(self, name: str) -> list[dict[str, Any]]:
        return read_metrics(self.run_dir / "logs" / f"{name}.jsonl")

    def endpoints(self) -> list[Endpoint]:
        """Every bound socket the actors and the controller announced in their logs, so far."""
        found = []
        for path in sorted((self.run_dir / "logs").glob("*.jsonl")):
            for event in self.log_events(path.stem):
                if event.get("event") == "actor started":
                    found += [Endpoint(event["actor_id"], channel, address)
                              for channel, address in event.get("endpoints", {}).items()]
                elif event.get("event") == "controller listening":
                    found += [Endpoint("controller", "rpc", event["head"]),
                              Endpoint("controller", "publish", event["publish"])]
        return sorted(set(found), key=lambda endpoint: endpoint.name)

    def pids(self) -> dict[str, int]:
        """The current process of every actor (the last one the launcher started)."""
        return started_actor_pids(self.run_dir)

    def crashes(self) -> dict[str, int]:
        """Per actor: restarts the launcher made, plus exits with a failure code."""
        counts: dict[str, int] = {}
        for event in self.log_events("launcher-0"):
            actor = event.get("actor")
            if event.get("event") == "actor crashed; restarting" or (
                    event.get("event") == "actor exited" and event.get("code") not in (0, None)):
                counts[actor] = counts.get(actor, 0) + 1
        return counts

    def trained_steps(self) -> int:
        return max((int(record.get("step", 0)) for record in read_metrics(self.run_dir / "metrics" / "train.jsonl")),
                   default=0)

    def metrics_lines(self) -> list[dict[str, Any]]:
        """The controller's records of every live actor's heartbeat counters (one line every 5 s)."""
        return read_metrics(self.run_dir / "metrics" / "actors.jsonl")

    def output_tail(self, chars: int = 3000) -> str:
        path = self.run_dir / "launcher_output.txt"
        return path.read_text(encoding="utf-8", errors="replace")[-chars:] if path.exists() else ""


def launch(run_dir: Path, steps: int, step_seconds: float, rollout_workers: int = 2) -> Run:
    """A small fully-async run that trains ``steps`` steps of about ``step_seconds`` each, the last one only once
    `Run.release` is called: however long the attack takes on a busy machine, the run outlasts it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    samples = GROUPS_PER_BATCH * SAMPLES_PER_GROUP
    release_file = run_dir / "release-last-step"
    release_file.unlink(missing_ok=True)
    spec = SimSpec(token_seconds=2e-4, train_sample_seconds=step_seconds / samples, length_median=16.0,
                   length_min=4, length_max=32, warmup_batches=0, measure_seconds=1.0, hold_at_version=steps,
                   release_file=str(release_file))
    env = with_repo_on_path(**{SPEC_ENV: str(spec.write(run_dir))})
    prompts = write_prompts(run_dir / "prompts.jsonl", count=256)
    command = [
        sys.executable, str(REPO / "launcher.py"), "--head", "--run-dir", str(run_dir), "--transport", "tcp",
        "--rollout-workers", str(rollout_workers), "--reward-workers", "1", *SLEEPING_FLAGS,
        "--rollout-max-batch-size", str(samples), "--rollout-max-response-len", str(spec.length_max),
        "--prompt-data", str(prompts), "--rollout-batch-size", str(GROUPS_PER_BATCH),
        "--n-samples-per-prompt", str(SAMPLES_PER_GROUP), "--max-staleness", "2", "--num-rollout", str(steps),
        "--heartbeat-interval", str(HEARTBEAT_S), "--no-progress", "--console-log-level", "error",
        "--no-use-tensorboard", "--no-plots",
    ]  # fmt: skip
    with open(run_dir / "launcher_output.txt", "w", encoding="utf-8") as output:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT)
    return Run(run_dir=run_dir, process=process, steps=steps, release_file=release_file)


def rss_mb(pid: int) -> float | None:
    """Resident memory of a process in MiB, None once it is gone."""
    kib = resident_kib(pid)
    return None if kib is None else kib / 1024


class RssSampler:
    """Samples every actor's resident memory in a thread: the value at start, the peak, and the latest."""

    def __init__(self, pids: dict[str, int], interval_s: float = 0.2) -> None:
        self.pids = pids
        self.before = {actor: rss_mb(pid) or 0.0 for actor, pid in pids.items()}
        self.peak = dict(self.before)
        self.latest = dict(self.before)
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.sample()

    def sample(self) -> None:
        for actor, pid in self.pids.items():
            value = rss_mb(pid)
            if value is not None:
                self.latest[actor] = value
                self.peak[actor] = max(self.peak[actor], value)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def wait_until(predicate: Any, timeout_s: float, what: str, run: Run, poll_s: float = 0.2) -> Any:
    """Poll ``predicate`` until it returns something truthy; a run that exits or a timeout raises with why."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if run.process.poll() is not None:
            raise RuntimeError(f"the run exited with {run.process.returncode} while waiting for {what}:\n"
                               f"{run.output_tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} after {timeout_s:.0f}s (run dir {run.run_dir})")
        time.sleep(poll_s)
