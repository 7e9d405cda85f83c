"""The end of a run of several policies: a certificate per policy in its own directory and the run's over them all,
plots and a summary per policy, read back from a run directory laid out as the launcher lays it out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.buffer.accounting import LOG, prompt_verdict
from actors.config import RunConfig, write_effective_config
from actors.launch.policy_scopes import policy_scopes, write_policy_configs
from actors.learner.weight_checks import WeightCheckLog
from actors.report.integrity import FILE, certify, recorded_run_failure
from actors.report.run_clock import RunClock
from actors.report.run_report import certify_run, report_run
from engines.weights.fingerprint import FingerprintCheck
from tests.actors.test_integrity import _kv_accounts
from tests.actors.test_run_report import write_jsonl

pytestmark = pytest.mark.unit

CONFIG = RunConfig(lora_rank=4, policies={"solver": {}, "proposer": {}})


def two_policy_run(run_dir: Path) -> None:
    """The run's config.yaml and the shared engine's KV account in RUN_DIR; each policy's learner's push checks in
    its own directory: the solver's engines served every push as sent, the proposer's version 1 differed."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_effective_config(CONFIG, run_dir)
    write_policy_configs(CONFIG, run_dir)
    _kv_accounts(run_dir, "rollout-0-0", (10, True, 0), (10, True, 0))
    solver, proposer = policy_scopes(CONFIG, run_dir)
    for scope, differ in ((solver, {}), (proposer, {"rollout-0-0": ["lora_A"]})):
        log = WeightCheckLog(scope.run_dir / "metrics")
        log.checked(1, FingerprintCheck("xxh3", matched=() if differ else ("rollout-0-0",), differ=differ))
        log.close()
        write_jsonl(scope.run_dir / "metrics" / "train.jsonl", [
            {"step": 1, "time": 4.0, "rollout/reward_mean": 0.25, "staleness/hist_0": 4},
            {"step": 2, "time": 9.0, "rollout/reward_mean": 0.5, "staleness/hist_1": 4}])


def test_each_policy_is_certified_in_its_directory_and_the_run_over_them_all(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    two_policy_run(tmp_path)
    certify_run(tmp_path, prompts=prompt_verdict, policies=["solver", "proposer"])

    solver = json.loads((tmp_path / "policies" / "solver" / FILE).read_text())
    proposer = json.loads((tmp_path / "policies" / "proposer" / FILE).read_text())
    run = json.loads((tmp_path / FILE).read_text())
    assert (solver["ok"], solver["checks"]["weights"]["verdict"]) == (True, "pass")
    assert (proposer["ok"], proposer["checks"]["weights"]["culprits"]) == (
        False, [{"version": 1, "engine": "rollout-0-0", "tensors": ["lora_A"]}])
    for own, name in ((solver, "solver"), (proposer, "proposer")):
        assert own["checks"]["caches"]["engines"] == 1  # the shared engines' accounts, in the run's directory
        assert own["checks"]["prompts"]["why"] == f"no buffer log at {tmp_path / 'policies' / name / LOG}"
        assert own["learner_steps"] == 2
    assert run == {"ok": False, "run_failed": None, "checks": {"caches": solver["checks"]["caches"]},
                   "policies": {"solver": solver, "proposer": proposer}}
    lines = capsys.readouterr().err.splitlines()
    assert lines[:3] == ["integrity of 2 policies: FAILED",
                         "  caches: pass (1 engines, 0 tokens sampled over KV of older weights)",
                         "  policy solver: OK"]
    assert lines[lines.index("  policy proposer: FAILED") + 1:][:2] == [
        "    weights: fail (1 pushes, 0 engine checks matched, 1 served differently, 0 unchecked)",
        "      version 1: rollout-0-0 serves other bits in lora_A"]
    # what tools/audit_run.py reads, given a policy's directory, as it reads a one-policy run's
    proposer_dir = tmp_path / "policies" / "proposer"
    assert certify(proposer_dir, prompts=prompt_verdict(proposer_dir))["checks"] == proposer["checks"]


def test_a_policy_with_engines_of_its_own_is_certified_on_its_own_engines_kv_accounts(tmp_path: Path) -> None:
    """Its rollout workers keep their accounts in its directory (they are its actors): its certificate reads those,
    the other policy's and the run's read the shared engines'."""
    two_policy_run(tmp_path)
    _kv_accounts(tmp_path / "policies" / "solver", "rollout-0-0@solver", (20, True, 0), (20, True, 5))
    certify_run(tmp_path, prompts=prompt_verdict, policies=["solver", "proposer"])

    solver = json.loads((tmp_path / "policies" / "solver" / FILE).read_text())
    proposer = json.loads((tmp_path / "policies" / "proposer" / FILE).read_text())
    assert solver["checks"]["caches"]["culprits"] == [{"engine": "rollout-0-0@solver", "stale_kv_tokens": 5}]
    assert proposer["checks"]["caches"]["verdict"] == "pass"
    run = json.loads((tmp_path / FILE).read_text())
    assert run["checks"]["caches"] == proposer["checks"]["caches"] and not run["ok"]


def test_a_failed_run_of_several_policies_records_why_in_every_certificate(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    two_policy_run(tmp_path)
    certify_run(tmp_path, policies=["solver", "proposer"], run_failed="learner@solver: crashed 6 times")
    assert capsys.readouterr().err.splitlines()[0] == (
        "integrity of 2 policies (of what ran before the run failed): FAILED")
    for directory in (tmp_path, tmp_path / "policies" / "solver", tmp_path / "policies" / "proposer"):
        assert recorded_run_failure(directory) == "learner@solver: crashed 6 times"


def test_each_policy_gets_its_plots_and_a_summary_timed_by_the_runs_clock(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    two_policy_run(tmp_path)
    RunClock.start(tmp_path, now=1_000.0).stop(now=1_154.2)
    report_run(tmp_path, ["solver", "proposer"])
    err = capsys.readouterr().err
    for name in ("solver", "proposer"):
        directory = tmp_path / "policies" / name
        assert (directory / "plots" / "curves.png").read_bytes().startswith(b"\x89PNG")
        assert f"policy {name}: {directory}\nlearner steps: 2  wall-clock: 2m 34s  final train reward: 0.500" in err
    assert not (tmp_path / "plots").exists()
