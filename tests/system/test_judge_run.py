"""The judge example as docs/custom-actors.md runs it: launcher.py with two judge actors and the reward function
that asks them, one judge killed with SIGKILL once it has given verdicts. The launcher restarts it, the run ends
well, every sample the learner trained on was rewarded with a judge's verdict, bit for bit, and both judges gave
verdicts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from bus.codec import decode
from bus.schema import Batch
from policies.rewards import prompt_text
from tests.system.test_fault_tolerance import current_pid, finish, launch
from tools.make_arithmetic_data import make_arithmetic_data

# The kill lands at judge-0-0's first verdict, while step 1 is being scored: the rest of that step and two more
# are scored after it, with judge-0-0 dead and then restarted, which is what the run must come through.
STEPS = 3
JUDGES = ("--custom-actor", "judge=examples.judge.actor:Judge", "--judge-workers", "2",
          "--custom-rm-path", "examples.judge.reward:judge_reward")


@pytest.mark.system
@pytest.mark.timeout(300)
def test_a_run_rewarded_by_two_judge_actors_trains_on_their_verdicts(tmp_path: Path, tiny_model_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JUDGE_MODEL", str(tiny_model_path))  # the launcher's environment, which its actors inherit
    data = make_arithmetic_data(tmp_path / "data", max_operand=9, eval_size=10)["train"]
    run_dir, recorded = tmp_path / "run", tmp_path / "batches"
    run = launch(run_dir, tiny_model_path, data, num_rollout=STEPS,
                 extra=(*JUDGES, "--rollout-workers", "1", "--save-debug-rollout-data", str(recorded)))
    try:
        _wait_for_verdicts(run_dir / "judge" / "judge-0-0.jsonl", run)
        os.kill(current_pid(run_dir, "judge-0-0"), signal.SIGKILL)
        output = finish(run)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, output[-4000:]
    assert '"actor": "judge-0-0", "code": -9' in (run_dir / "logs" / "launcher-0.jsonl").read_text(), \
        "the killed judge was not restarted"

    verdicts: dict[tuple[str, str], float] = {}
    for judge in ("judge-0-0", "judge-0-1"):
        ledger = (run_dir / "judge" / f"{judge}.jsonl").read_text(encoding="utf-8").splitlines()
        assert ledger, f"{judge} gave no verdict"
        verdicts.update({(entry["prompt"], entry["response"]): entry["p_yes"] for entry in map(json.loads, ledger)})
    batches = [decode(path.read_bytes()) for path in sorted(recorded.glob("batch_*.msgpack"))]
    assert len(batches) == STEPS and all(isinstance(batch, Batch) for batch in batches)
    trained = [sample for batch in batches for sample in batch.samples]
    assert [sample.reward for sample in trained] == [verdicts[(prompt_text(s.prompt), s.response)] for s in trained]


def _wait_for_verdicts(ledger: Path, run: subprocess.Popen[str], timeout: float = 120) -> None:
    """Until the judge wrote a verdict: then it is serving the run's reward worker."""
    deadline = time.monotonic() + timeout
    while not (ledger.exists() and ledger.stat().st_size):
        assert run.poll() is None and time.monotonic() < deadline, "the judge gave no verdict"
        time.sleep(0.1)
