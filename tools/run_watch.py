"""Watching a run from outside: its actors' processes (pid, resident memory, CPU time) and the records its actors
append to the run directory, read as they grow.

Benchmarks and fault tools (soak, hostile input, chaos, pipeline) watch runs they started through launcher.py: the
launcher logs each actor process it starts (RUN_DIR/logs/launcher-0.jsonl), and /proc tells the rest.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LAUNCHER_LOG = Path("logs") / "launcher-0.jsonl"
TRAIN_METRICS = Path("metrics") / "train.jsonl"
KILLED_AT_STOP = ("actor ignored SIGTERM", "actor was stopped")  # the launcher's words for an actor it had to kill
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Sample:
    """One look at the run: seconds since it became "running", resident KiB per process, steps trained."""

    t: float
    rss_kib: dict[str, int]  # actor id (and "launcher", "template") -> VmRSS
    pids: dict[str, int]
    steps: int
    load: float  # 1-minute load average of the machine


class JsonlTail:
    """The records another process appended to a JSON-lines file since the last read: the soak re-reads its files
    every few seconds for minutes, so it parses each line once. A torn last line waits for its end."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""

    def read(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        records = []
        for line in lines:
            with contextlib.suppress(json.JSONDecodeError):
                records.append(json.loads(line))
        return records


def resident_kib(pid: int) -> int | None:
    """VmRSS of a live process; None once it is gone (or a zombie, which has none)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def children_of(parent: int) -> list[int]:
    """Pids whose parent is `parent` (the launcher's actor template is one; /proc has no children file here)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                if int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                    found.append(int(entry))
    return found


class RunWatch:
    """Follows one run's launcher log and learner metrics: the latest pid per actor, starts per actor, steps."""

    def __init__(self, run_dir: Path, launcher_pid: int) -> None:
        self.run_dir = run_dir
        self.launcher_pid = launcher_pid
        self.log = JsonlTail(run_dir / LAUNCHER_LOG)
        self.train = JsonlTail(run_dir / TRAIN_METRICS)
        self.pids: dict[str, int] = {}
        self.starts: dict[str, int] = {}
        self.crashes: dict[str, int] = {}
        self.killed: list[str] = []  # actors the launcher killed because they did not exit on SIGTERM in time
        self.step_walls: list[float] = []
        self.template: int | None = None

    def update(self) -> None:
        for record in self.log.read():
            actor = record.get("actor")
            if record.get("event") == "actor process started":
                self.pids[actor] = int(record["pid"])
                self.starts[actor] = self.starts.get(actor, 0) + 1
            elif str(record.get("event", "")).startswith("actor crashed"):
                self.crashes[actor] = self.crashes.get(actor, 0) + 1
            elif str(record.get("event", "")).startswith(KILLED_AT_STOP):
                self.killed.append(actor)
        self.step_walls += [float(r["wall"]) for r in self.train.read() if "wall" in r]

    def restarts(self) -> dict[str, int]:
        """Per actor that restarted: its starts beyond the first, or its crashes if more (one not restarted yet)."""
        counts = {actor: max(self.starts.get(actor, 1) - 1, self.crashes.get(actor, 0))
                  for actor in {*self.starts, *self.crashes}}
        return {actor: count for actor, count in counts.items() if count > 0}

    def sample(self, t: float) -> Sample:
        self.update()
        pids = dict(self.pids)
        pids["launcher"] = self.launcher_pid
        if self.template is None or resident_kib(self.template) is None:
            others = [p for p in children_of(self.launcher_pid) if p not in self.pids.values()]
            self.template = others[0] if len(others) == 1 else None  # forking off: no template
        if self.template is not None:
            pids["template"] = self.template
        rss = {who: kib for who, pid in pids.items() if (kib := resident_kib(pid)) is not None}
        return Sample(t=t, rss_kib=rss, pids=pids, steps=len(self.step_walls), load=os.getloadavg()[0])


def started_actor_pids(run_dir: Path) -> dict[str, int]:
    """The latest process the launcher started for each actor."""
    return {record["actor"]: int(record["pid"]) for record in JsonlTail(run_dir / LAUNCHER_LOG).read()
            if record.get("event") == "actor process started"}


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a live process; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def stop_launcher(process: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    """End a launcher that is still running (a timeout, an interrupt): SIGTERM stops its actors in order; SIGKILL
    after `timeout_s` (its actors then get SIGTERM through PDEATHSIG)."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
