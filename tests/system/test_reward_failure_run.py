"""Runs whose user function fails on every sample, through launcher.py: each ends as failed by itself (exit 1, no
restart loop) with the function's error on the console and in the failing worker's log, which holds a bounded number
of warnings rather than one per sample.

A reward function that always raises runs on the sleeping engine and trainer, so it costs seconds. A generate plugin
that always raises (slime's retool plugin did, and its run dropped prompt groups until a timeout killed it) runs on
the torch engine and trainer with a tiny model."""

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
GENERATE_RAISES = "tests.support.generate_plugins:always_raises"


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _failed_run(tmp_path: Path, actor: str, *flags: str, env: dict[str, str] | None = None) -> tuple[dict, str]:
    """Launch a run of `flags` that must fail by itself because of `actor`; check how it says so on the console, in
    the launcher's log and in its certificate. Returns `actor`'s one error record and the console's stderr."""
    run_dir = tmp_path / "run"
    completed = subprocess.run(
        [sys.executable, str(REPO / "launcher.py"), "--head", "--run-dir", str(run_dir),
         "--prompt-data", str(write_prompts(tmp_path / "prompts.jsonl")), "--rollout-batch-size", "2",
         "--n-samples-per-prompt", "4", "--num-rollout", "5", "--heartbeat-interval", "0.25",
         "--no-progress", "--no-use-tensorboard", "--no-plots", *flags],
        cwd=REPO, env=env or with_repo_on_path(), capture_output=True, text=True, timeout=150, check=False)
    output = completed.stdout[-3000:] + completed.stderr[-3000:]
    assert completed.returncode == 1, output

    records = _records(run_dir / "logs" / f"{actor}.jsonl")
    (ended,) = [r for r in records if r["level"] == "error"]
    launcher = _records(run_dir / "logs" / "launcher-0.jsonl")
    # The worker's exit, or the controller's abort that the worker asked for, whichever reaches the launcher first:
    # either way the launcher names the worker and gives its reason whole.
    (failed,) = [r["reason"] for r in launcher if r["event"] == "run failed"]
    assert failed in (f"{actor}: {ended['reason']}", f"aborted by the controller: {actor}: {ended['reason']}"), \
        output
    assert sum(r["event"] == "actor process started" and r["actor"] == actor for r in launcher) == 1
    assert ended["reason"] in completed.stderr  # the launcher's last word on the console
    # ... and the certificate that follows it covers what ran before the failure; it does not read "OK"
    certificate = json.loads((run_dir / "integrity.json").read_text())
    assert certificate["run_failed"] == failed, certificate
    assert "integrity: OK" not in completed.stderr
    assert "integrity (of what ran before the run failed, before its first learner step)" in completed.stderr
    warnings = [r for r in records if r["level"] == "warning"]
    assert 5 <= len(warnings) <= 5 + 1 + 2, [r["event"] for r in warnings]  # not one per failed sample
    return ended, completed.stderr


@pytest.mark.system
@pytest.mark.timeout(180)
def test_run_with_an_always_raising_reward_fails_with_its_error_and_few_warnings(tmp_path: Path) -> None:
    spec = SimSpec(token_seconds=1e-4, length_min=8, length_max=32)
    env = with_repo_on_path(**{SPEC_ENV: str(spec.write(tmp_path))})
    sleeping = [arg for name, value in SLEEPING.items() for arg in ("--" + name.replace("_", "-"), value)]
    ended, _ = _failed_run(tmp_path, "reward-0-0", *sleeping, "--rollout-max-response-len", "32",
                           "--custom-rm-path", RAISES, "--reward-failure-limit", "100", env=env)
    assert ended["reason"].startswith(f"reward function {RAISES} failed on 100 samples in a row, none scored "
                                      "(--reward-failure-limit 100); last error: raised ValueError: cannot grade "
                                      "label '")


@pytest.mark.system
@pytest.mark.timeout(180)
def test_run_with_an_always_raising_generate_plugin_ends_by_itself_with_its_error(
        tmp_path: Path, tiny_model_path: Path) -> None:
    ended, stderr = _failed_run(tmp_path, "rollout-0-0", "--hf-checkpoint", str(tiny_model_path),
                                "--rollout-max-response-len", "8", "--custom-generate-function-path", GENERATE_RAISES,
                                "--generate-failure-limit", "16")
    assert ended["reason"].startswith(f"generate function {GENERATE_RAISES} failed on 16 samples in a row, none "
                                      "generated (--generate-failure-limit 16); last error: raised RuntimeError('tool "
                                      "sandbox unreachable for group ")
    assert "Traceback" in stderr and "RuntimeError: tool sandbox unreachable" in stderr  # the first one's, whole
