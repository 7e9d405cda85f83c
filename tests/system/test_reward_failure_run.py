"""A run whose reward function raises on every sample, through launcher.py: it ends as failed (exit 1, no restart
loop) with the reward function's error in the reward worker's log, which holds a bounded number of warnings
rather than one per sample. The engine and trainer are the sleeping ones, so the run costs seconds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.inprocess import SLEEPING, write_prompts
from tools.repo_env import with_repo_on_path
from tools.sim.pipeline import SPEC_ENV, SimSpec

REPO = Path(__file__).resolve().parents[2]
RAISES = "tests.support.reward_plugins:always_raises"


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.mark.system
@pytest.mark.timeout(180)
def test_run_with_an_always_raising_reward_fails_with_its_error_and_few_warnings(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    spec = SimSpec(token_seconds=1e-4, length_min=8, length_max=32)
    env = with_repo_on_path(**{SPEC_ENV: str(spec.write(tmp_path))})
    sleeping = [arg for name, value in SLEEPING.items() for arg in ("--" + name.replace("_", "-"), value)]
    completed = subprocess.run(
        [sys.executable, str(REPO / "launcher.py"), "--head", "--run-dir", str(run_dir), *sleeping,
         "--prompt-data", str(write_prompts(tmp_path / "prompts.jsonl")), "--rollout-batch-size", "2",
         "--n-samples-per-prompt", "4", "--rollout-max-response-len", "32", "--num-rollout", "5",
         "--custom-rm-path", RAISES, "--reward-failure-limit", "100", "--heartbeat-interval", "0.25",
         "--no-progress", "--no-use-tensorboard", "--no-plots"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=150, check=False)
    output = completed.stdout[-3000:] + completed.stderr[-3000:]
    assert completed.returncode == 1, output

    reward = _records(run_dir / "logs" / "reward-0-0.jsonl")
    (ended,) = [r for r in reward if r["level"] == "error"]
    assert ended["reason"].startswith(f"reward function {RAISES} failed on 100 samples in a row, none scored "
                                      "(--reward-failure-limit 100); last error: raised ValueError: cannot grade "
                                      "label '")
    launcher = _records(run_dir / "logs" / "launcher-0.jsonl")
    # The worker's exit, or the controller's abort that the worker asked for, whichever reaches the launcher first:
    # either way the launcher names the worker and gives its reason whole.
    (failed,) = [r["reason"] for r in launcher if r["event"] == "run failed"]
    assert failed in (f"reward-0-0: {ended['reason']}", f"aborted by the controller: reward-0-0: {ended['reason']}"), \
        output
    assert sum(r["event"] == "actor process started" and r["actor"] == "reward-0-0" for r in launcher) == 1
    assert ended["reason"] in completed.stderr  # the launcher's last word on the console
    # ... and the certificate that follows it covers what ran before the failure; it does not read "OK"
    certificate = json.loads((run_dir / "integrity.json").read_text())
    assert certificate["run_failed"] == failed, certificate
    assert "integrity: OK" not in completed.stderr
    assert "integrity (of what ran before the run failed, before its first learner step)" in completed.stderr
    warnings = [r for r in reward if r["level"] == "warning"]
    assert 5 <= len(warnings) <= 5 + 1 + 2, [r["event"] for r in warnings]  # not one per failed sample
