"""Liveness of a real run when the head's own processes fail (issue #16).

A controller killed with -9 mid-run is restarted by its launcher on the same head address; every actor finds the
new one, so the run still ends the ordinary way: the learner's stop reaches everyone through the new controller's
broadcast and each actor stops because it was told to, not because its launcher signalled it. A reward worker
killed in the same run costs seconds of training, and a killed evaluator loses no eval round.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.system.test_fault_tolerance import (
    current_pid,
    finish,
    gaps_after,
    launch,
    trained_steps,
    wait_for_step,
)
from tools.make_arithmetic_data import make_arithmetic_data


def wait_for_log(process: subprocess.Popen[str], path: Path, text: str, timeout: float = 120) -> None:
    """Until a line of `path` holds `text` (the run still going)."""
    wait_for(process, lambda: path.exists() and text in path.read_text(encoding="utf-8"), f"{path} said {text}",
             timeout)


def stop_reasons(run_dir: Path) -> dict[str, str]:
    """The reason each actor's last process gave for stopping, from its own log."""
    reasons = {}
    for path in (run_dir / "logs").glob("*.jsonl"):
        for line in path.read_text().splitlines():
            if '"actor stopped"' in line:
                reasons[path.stem] = json.loads(line).get("reason", "")
    return reasons


def registrations(run_dir: Path, member: str) -> int:
    """How many times `member` registered with a controller (each controller process logs its first sight)."""
    lines = (run_dir / "logs" / "controller.jsonl").read_text(encoding="utf-8").splitlines()
    return sum(record.get("member") == member and record.get("event") in ("member joined", "member returned")
               for record in map(json.loads, lines))


def wait_for(process: subprocess.Popen[str], condition: Callable[[], bool], what: str, timeout: float = 120) -> None:
    """Until `condition` holds (the run still going)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"the run ended or {timeout}s passed before {what}")
        time.sleep(0.05)


@pytest.mark.system
@pytest.mark.timeout(600)
def test_a_killed_controller_and_reward_worker_neither_stall_the_run_nor_spoil_its_clean_stop(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    """Two kills in one run. The controller, killed first, is restarted on the same head address and every actor
    finds it, so the run still ends the ordinary way (each actor stops because the new controller told it to).
    The reward worker, killed once it registered with that new controller: the groups it held are re-issued when
    the roster reports its death (the rollout workers that handed them over name them), not when their leases
    expire 60 s later, so training stalls for seconds."""
    task = make_arithmetic_data(tmp_path / "data", max_operand=9, eval_size=10)["train"]
    run_dir = tmp_path / "run"
    # Steps enough after the reward worker's kill, which waits for the restarted controller while the learner trains
    # on (~0.1 s a step here; 30 steps left ~20 after the kill, on a busy machine); --lease-timeout 60 sets a lease
    # expiry apart from a roster-driven re-issue.
    steps = 40
    run = launch(run_dir, tiny_model_path, task, num_rollout=steps, extra=("--lease-timeout", "60"))
    try:
        wait_for_step(run, run_dir, 3)
        os.kill(current_pid(run_dir, "controller"), signal.SIGKILL)
        wait_for(run, lambda: registrations(run_dir, "reward-0-0") >= 2,
                 "the reward worker registered with the restarted controller")
        os.kill(current_pid(run_dir, "reward-0-0"), signal.SIGKILL)
        killed_at = time.time()
        output = finish(run)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, output[-4000:]
    assert trained_steps(run_dir) == steps
    launcher_log = (run_dir / "logs" / "launcher-0.jsonl").read_text()
    for victim in ("controller", "reward-0-0"):
        assert f'"actor": "{victim}", "code": -9' in launcher_log, f"{victim} was not killed and restarted"
    assert "actor ignored SIGTERM" not in launcher_log
    gaps = gaps_after(run_dir, killed_at)
    stall = max(gaps, default=0.0)
    assert gaps and stall < 20, f"training stalled {stall:.1f}s after the reward worker died"
    reasons = stop_reasons(run_dir)
    workers = {name: reason for name, reason in reasons.items() if name not in ("controller", "learner")}
    assert set(workers) >= {"buffer", "rollout-0-0", "rollout-0-1", "reward-0-0"}, reasons
    # Told by the controller, either way: its stop broadcast, or (an actor that had not yet found the restarted
    # controller when the learner, which kept training without it, ended the run) the refusal of its
    # re-registration. Not the launcher's signal, nor the supervisor's "the run ended".
    told = ("controller: stop", "controller: the run is draining", "controller: the run is stopped")
    unheard = {name: reason for name, reason in workers.items() if not reason.startswith(told)}
    assert not unheard, f"actors that never heard the new controller's stop: {unheard}"


@pytest.mark.system
@pytest.mark.timeout(600)
def test_every_eval_round_is_generated_by_the_version_it_reports_and_a_killed_evaluator_loses_none(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    """The evaluator has the learner pin the engines on an evaluated version's weights until the round reports, and
    a worker generates an eval group only with those weights: no token of a round comes from newer weights. The
    evaluator is killed -9 mid-run: the pin holds, its restart starts the open round again, and every round is
    written once."""
    data = make_arithmetic_data(tmp_path / "data", max_operand=9, eval_size=24)
    run_dir = tmp_path / "run"
    run = launch(run_dir, tiny_model_path, data["train"], num_rollout=12,
                 extra=("--eval-prompt-data", "held", str(data["eval"]), "--eval-interval", "3",
                        "--n-samples-per-eval-prompt", "2", "--eval-temperature", "1.0"))
    try:
        wait_for_log(run, run_dir / "logs" / "evaluator.jsonl", '"version": 3')  # round 3 started
        killed = current_pid(run_dir, "evaluator")
        os.kill(killed, signal.SIGKILL)
        output = finish(run)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, output[-4000:]
    rounds = [json.loads(line) for line in (run_dir / "metrics" / "eval.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in rounds) == [0, 3, 6, 9, 12], rounds  # each once, the killed one included
    assert current_pid(run_dir, "evaluator") != killed, "the evaluator was not restarted"
    off = {r["step"]: r["eval/held/off_version_samples"] for r in rounds}
    assert not any(off.values()), f"eval samples generated by other weights than the version reported: {off}"
    assert all(r["eval/held/failed_samples"] == 0 for r in rounds)
    buffer_log = (run_dir / "logs" / "buffer.jsonl").read_text().splitlines()
    buffer_warnings = [json.loads(line)["event"] for line in buffer_log if '"level": "warning"' in line]
    assert not buffer_warnings, f"a run that ended normally left warnings in the buffer's log: {buffer_warnings}"
