"""A run that is deliberately wedged ends within --hang-timeout plus a margin, naming who stopped (issue #17).

The learner is stopped with SIGSTOP mid-run: its process lives, so its launcher restarts nothing, and the rollout
workers fill the staleness window and wait. With nothing finished anywhere for --hang-timeout, the controller
asks every actor what it waits for, writes RUN_DIR/hang-report.txt and fails the run on every launcher, naming the
silent learner. The same command then resumes the run from the learner's last checkpoint and the buffer's log.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.system.test_fault_tolerance import current_pid, finish, launch, trained_steps, wait_for_step
from tools.audit_run import audit
from tools.make_arithmetic_data import make_arithmetic_data

HANG_TIMEOUT_S = 5.0
STEPS = 30  # far more than a busy machine's tiny-model learner trains between seeing step 2 and its SIGSTOP landing
MARGIN_S = 25.0  # state reports (5 s at most) and the launcher's stop of the others


@pytest.mark.system
@pytest.mark.timeout(300)
def test_a_run_wedged_by_a_stopped_learner_fails_naming_it_and_resumes(tmp_path: Path, tiny_model_path: Path) -> None:
    task = make_arithmetic_data(tmp_path / "data", max_operand=9, eval_size=10)["train"]
    run_dir = tmp_path / "run"
    flags = ("--hang-timeout", str(HANG_TIMEOUT_S))
    run = launch(run_dir, tiny_model_path, task, num_rollout=STEPS, extra=flags)
    try:
        wait_for_step(run, run_dir, 2)
        os.kill(current_pid(run_dir, "learner"), signal.SIGSTOP)
        stopped_at = time.monotonic()
        output = finish(run, timeout=HANG_TIMEOUT_S + MARGIN_S + 60)
        ended_after = time.monotonic() - stopped_at
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 1, output[-4000:]
    assert ended_after < HANG_TIMEOUT_S + MARGIN_S, f"the wedged run took {ended_after:.0f} s to end"
    assert "run hung: no progress for" in output and "silent: learner" in output, output[-4000:]
    report = (run_dir / "hang-report.txt").read_text()
    assert report.startswith("no progress for") and "learner (pid" in report
    waiting = [line for line in report.splitlines() if line.startswith("rollout-0-0:")]
    assert waiting and "waits for" in waiting[0], report[:3000]
    assert "===== buffer" in report, "the live actors' stacks are in the report"
    stopped_at_step = trained_steps(run_dir)
    assert stopped_at_step < STEPS

    again = launch(run_dir, tiny_model_path, task, num_rollout=STEPS, extra=flags)
    output = finish(again)
    assert again.returncode == 0, output[-4000:]
    assert trained_steps(run_dir) == STEPS
    result = audit(run_dir)
    assert result.ok, result.problems
