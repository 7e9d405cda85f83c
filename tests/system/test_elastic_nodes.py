"""Worker nodes join a running job and leave it: one stops gracefully, one dies with kill -9 of every process it
had. The head's run goes on with whoever is there, re-issues what the lost node held, and trains every accepted
sample exactly once (`tools/audit_run.py`).

Each worker node is a launcher process on this machine with its own loopback address, sharing the run directory
as the nodes of a cluster share a filesystem.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from bus.address import free_port
from tests.system.test_fault_tolerance import finish, launch, trained_steps, wait_for_step
from tools.audit_run import audit
from tools.make_arithmetic_data import make_arithmetic_data

REPO = Path(__file__).resolve().parents[2]
STEPS = 1000  # ~24 steps/s here: long enough for two nodes to start (~6 s each) and leave mid-run


def join(run_dir: Path, head: str, rank: int) -> subprocess.Popen[str]:
    command = [sys.executable, str(REPO / "launcher.py"), "--head-address", head, "--node-rank", str(rank),
               "--host", f"127.0.0.{rank + 1}", "--run-dir", str(run_dir), "--rollout-workers", "1",
               "--reward-workers", "1", "--heartbeat-interval", "0.25", "--no-progress"]
    return subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def controller_events(run_dir: Path, member: str) -> list[str]:
    lines = (run_dir / "logs" / "controller.jsonl").read_text().splitlines()
    return [record["event"] for record in map(json.loads, lines) if record.get("member") == member]


def wait(condition: Callable[[], bool], what: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.2)


def node_pids(run_dir: Path, rank: int) -> list[int]:
    lines = (run_dir / "logs" / f"launcher-{rank}.jsonl").read_text().splitlines()
    return [record["pid"] for record in map(json.loads, lines) if record.get("event") == "actor process started"]


@pytest.mark.system
@pytest.mark.timeout(600)
def test_worker_nodes_join_and_leave_a_running_job_and_every_sample_trains_once(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    data = make_arithmetic_data(tmp_path / "data", max_operand=9, eval_size=10)["train"]
    run_dir, head_address = tmp_path / "run", f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    head = launch(run_dir, tiny_model_path, data, num_rollout=STEPS,
                  extra=("--head-address", head_address, "--rollout-workers", "1", "--rollout-max-response-len", "8"))
    nodes: list[subprocess.Popen[str]] = []
    try:
        wait_for_step(head, run_dir, 3)
        graceful, lost = join(run_dir, head_address, 1), join(run_dir, head_address, 2)  # both join the run
        nodes += [graceful, lost]
        for rank in (1, 2):
            wait(lambda rank=rank: "member joined" in controller_events(run_dir, f"rollout-{rank}-0"),
                 f"node {rank}'s rollout worker")
        joined_at = trained_steps(run_dir)
        wait(lambda: trained_steps(run_dir) >= joined_at + 5, "five steps with both nodes")
        graceful.send_signal(signal.SIGTERM)
        assert finish(graceful, timeout=60) is not None and graceful.returncode == 128 + signal.SIGTERM
        left_at = trained_steps(run_dir)
        wait(lambda: trained_steps(run_dir) >= left_at + 5, "five steps after node 1 left")
        assert trained_steps(run_dir) < STEPS - 20, "the run ended too soon to see a node lost mid-run"
        for pid in [lost.pid, *node_pids(run_dir, 2)]:  # the whole node at once: its launcher and every actor
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        lost.wait(timeout=30)
        output = finish(head)
    finally:
        for process in [head, *nodes]:
            if process.poll() is None:
                process.kill()
    assert head.returncode == 0, output[-4000:]
    for member in ("rollout-1-0", "reward-1-0"):
        events = controller_events(run_dir, member)
        assert events[0] == "member joined" and "member left" in events, (member, events)
    for member in ("rollout-2-0", "reward-2-0"):
        events = controller_events(run_dir, member)
        assert events[0] == "member joined" and "member died" in events, (member, events)
    report = audit(run_dir)
    assert report.ok, report.problems
    assert report.trained_batches == STEPS
