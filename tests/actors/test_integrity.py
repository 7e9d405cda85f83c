"""The integrity certificate from the learner's push records: pass, fail with its culprits, partial with its
reasons, not run with why; written as RUN_DIR/integrity.json and told in summary lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.learner.weight_checks import WeightCheckLog
from actors.report.integrity import FILE, certify, describe, recorded_run_failure, write_certificate
from actors.report.run_report import certify_run
from engines.weights.fingerprint import FingerprintCheck

pytestmark = pytest.mark.unit


def _log(run_dir: Path) -> WeightCheckLog:
    return WeightCheckLog(run_dir / "metrics")


def test_a_run_whose_every_push_matched_passes(tmp_path: Path) -> None:
    log = _log(tmp_path)
    for version in range(3):
        log.checked(version, FingerprintCheck("xxh3", matched=("rollout-0-0", "rollout-0-1")))
    log.close()
    certificate = write_certificate(tmp_path)
    assert json.loads((tmp_path / FILE).read_text()) == certificate
    assert certificate["ok"] and certificate["checks"]["weights"] == {
        "verdict": "pass", "pushes": 3, "engine_checks_matched": 6, "served_differently": 0, "unchecked": 0}
    assert describe(certificate)[0] == "integrity: OK"


def test_an_engine_that_served_other_bits_fails_the_run_even_once_repaired(tmp_path: Path) -> None:
    log = _log(tmp_path)
    log.checked(1, FingerprintCheck("xxh3", matched=("rollout-0-0",), differ={"rollout-0-1": ["lm_head.weight"]}))
    log.checked(1, FingerprintCheck("xxh3", matched=("rollout-0-0", "rollout-0-1")))  # the repush matched
    log.close()
    certificate = certify(tmp_path)
    weights = certificate["checks"]["weights"]
    assert not certificate["ok"] and weights["verdict"] == "fail"
    assert weights["culprits"] == [{"version": 1, "engine": "rollout-0-1", "tensors": ["lm_head.weight"]}]
    assert "    version 1: rollout-0-1 serves other bits in lm_head.weight" in describe(certificate)


def test_pushes_or_engines_that_could_not_be_checked_make_it_partial_with_the_reason(tmp_path: Path) -> None:
    log = _log(tmp_path)
    log.checked(0, FingerprintCheck("xxh3", matched=("a",), unchecked={"b": "its engine cannot fingerprint"}))
    log.not_checked(1, "the sglang weight transport cannot fingerprint")
    log.close()
    certificate = certify(tmp_path)
    weights = certificate["checks"]["weights"]
    assert certificate["ok"] and weights["verdict"] == "partial"
    assert weights["unchecked_why"] == ["version 0: b: its engine cannot fingerprint",
                                        "version 1: the sglang weight transport cannot fingerprint"]


def test_a_run_without_records_says_the_check_did_not_run_and_why(tmp_path: Path) -> None:
    certificate = certify(tmp_path)
    assert certificate["ok"] and certificate["checks"]["weights"]["verdict"] == "not run"
    assert "--weight-check off" in describe(certificate)[1]


def _steps(run_dir: Path, count: int) -> None:
    (run_dir / "metrics").mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics" / "train.jsonl").write_text("".join(json.dumps({"step": step, "time": float(step)}) + "\n"
                                                             for step in range(1, count + 1)))


def test_a_failed_runs_certificate_says_it_covers_the_steps_before_the_failure_not_ok(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`launcher.py: run failed: ...` was followed by `integrity: OK`, which read as if all was well."""
    _steps(tmp_path, 3)
    failure = "reward-0-0: reward function failed on 200 samples in a row"
    certify_run(tmp_path, run_failed=failure)
    headline = capsys.readouterr().err.splitlines()[0]
    assert headline == "integrity (of the 3 learner steps that ran before the run failed): no check failed"
    recorded = json.loads((tmp_path / FILE).read_text())
    assert recorded["ok"] and recorded["run_failed"] == failure and recorded["learner_steps"] == 3
    assert recorded_run_failure(tmp_path) == failure  # what tools/audit_run.py tells again


def test_a_run_that_failed_before_its_first_step_says_so(tmp_path: Path) -> None:
    certificate = write_certificate(tmp_path, run_failed="the learner could not load its model")
    assert describe(certificate)[0] == ("integrity (of what ran before the run failed, before its first learner "
                                        "step): no check failed")


def test_a_failed_check_of_a_failed_run_still_reads_failed(tmp_path: Path) -> None:
    _steps(tmp_path, 1)
    certificate = certify(tmp_path, prompts={"verdict": "fail", "prompt_groups": 1, "fates": {}, "skipped": 0,
                                             "regenerated": {"evictions": 0, "leased_again": 0}},
                          run_failed="stopped")
    assert describe(certificate)[0] == "integrity (of the 1 learner step that ran before the run failed): FAILED"


def test_a_finished_runs_certificate_records_its_steps_and_no_failure(tmp_path: Path) -> None:
    _steps(tmp_path, 2)
    certificate = write_certificate(tmp_path)
    assert (certificate["learner_steps"], certificate["run_failed"]) == (2, None)
    assert describe(certificate)[0] == "integrity: OK"
    assert recorded_run_failure(tmp_path) is None


def test_the_buffers_account_of_its_prompts_is_a_check_with_its_length_table(tmp_path: Path) -> None:
    prompts = {"verdict": "fail", "prompt_groups": 10, "fates": {"trained": 8, "in flight": 2}, "skipped": 2,
               "regenerated": {"evictions": 3, "leased_again": 1}, "eviction_staleness": {"3": 3},
               "by_length": {"buckets": [{"lengths": "<= 4.0", "groups": 6, "trained": 6, "evictions": 0},
                                         {"lengths": "> 4.0", "groups": 4, "trained": 2, "evictions": 3}],
                             "evicted_vs_trained_length": 1.8}}
    certificate = certify(tmp_path, prompts=prompts)
    assert not certificate["ok"] and certificate["checks"]["prompts"] == prompts
    lines = describe(certificate)
    assert "  prompts: fail (10 prompt groups: 8 trained, 2 in flight; 2 skipped; regenerated: 3 evicted as stale, " \
           "1 leased again)" in lines
    assert "    mean response length > 4.0: 4 groups, 2 trained, 3 evictions" in lines
    assert "    evicted answers were 1.80x as long as trained ones" in lines


def test_a_record_torn_by_a_kill_is_skipped_not_fatal(tmp_path: Path) -> None:
    log = _log(tmp_path)
    log.checked(0, FingerprintCheck("xxh3", matched=("a",)))
    log.close()
    with open(tmp_path / "metrics" / "weight_checks.jsonl", "a") as file:
        file.write('{"version": 1, "matc')
    assert certify(tmp_path)["checks"]["weights"]["pushes"] == 1


def _kv_accounts(run_dir: Path, engine: str, *records: tuple[int, bool, int]) -> None:
    """What a rollout worker appends (`actors/rollout/kv_cache_log.py`): (pid, recomputes_on_update, stale tokens)."""
    folder = run_dir / "metrics" / "kv_cache"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{engine}.jsonl", "a") as file:
        for version, (pid, recomputes, stale) in enumerate(records):
            file.write(json.dumps({"time": 0.0, "pid": pid, "version": version, "recomputes_on_update": recomputes,
                                   "stale_kv_tokens": stale}) + "\n")


def test_an_engine_that_sampled_over_an_older_cache_it_promised_to_recompute_fails_the_caches_check(
    tmp_path: Path,
) -> None:
    _kv_accounts(tmp_path, "rollout-0-0", (10, True, 0), (10, True, 0))
    # 4 tokens over an old cache, then a restart (its count starts again), then 3 more: 7 in all
    _kv_accounts(tmp_path, "rollout-0-1", (11, True, 0), (11, True, 4), (12, True, 0), (12, True, 3))
    certificate = certify(tmp_path)
    caches = certificate["checks"]["caches"]
    assert not certificate["ok"] and caches == {
        "verdict": "fail", "engines": 2, "stale_kv_tokens": 7, "kept_by_setting": 0,
        "culprits": [{"engine": "rollout-0-1", "stale_kv_tokens": 7}]}
    assert ("    rollout-0-1 sampled 7 tokens over keys/values of older weights although it recomputes them at every "
            "update") in describe(certificate)


def test_caches_kept_across_updates_by_setting_pass_and_are_counted(tmp_path: Path) -> None:
    _kv_accounts(tmp_path, "rollout-0-0", (10, False, 2), (10, False, 9))
    certificate = certify(tmp_path)
    assert certificate["ok"] and certificate["checks"]["caches"] == {
        "verdict": "pass", "engines": 1, "stale_kv_tokens": 0, "kept_by_setting": 9}
    assert "  caches: pass (1 engines, 0 tokens sampled over KV of older weights, 9 over older KV kept by setting)" \
        in describe(certificate)


def test_engines_that_cannot_account_for_their_cache_leave_the_caches_check_not_run(tmp_path: Path) -> None:
    caches = certify(tmp_path)["checks"]["caches"]
    assert caches["verdict"] == "not run" and "flushed before every weight update" in caches["why"]


def test_an_sglang_engine_whose_checksum_shows_the_difference_is_named_with_what_shows_it(tmp_path: Path) -> None:
    log = _log(tmp_path)
    why = "serves the same weights as after version 1: its SGLang checksum did not change although 3 tensors did"
    log.checked(2, FingerprintCheck("xxh3", matched=("rollout-0-0",), differ={"rollout-0-1": []},
                                    why={"rollout-0-1": why}))
    log.close()
    certificate = certify(tmp_path)
    assert certificate["checks"]["weights"]["culprits"] == [
        {"version": 2, "engine": "rollout-0-1", "tensors": [], "why": why}]
    assert f"    version 2: rollout-0-1 {why}" in describe(certificate)


def test_the_caches_check_sums_what_the_engines_prefix_caches_reused_over_engines_and_restarts(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "metrics" / "kv_cache"
    folder.mkdir(parents=True)
    lives = {"rollout-0-0": [(10, 30, 70, 0), (10, 60, 100, 5), (11, 20, 20, 0)], "rollout-0-1": [(12, 90, 40, 1)]}
    for engine, records in lives.items():  # (pid, reused, prefilled, stale): cumulative per process
        with open(folder / f"{engine}.jsonl", "a") as file:
            for pid, reused, prefilled, stale in records:
                counts = {"reused_tokens": reused, "prefilled_tokens": prefilled, "stale_tokens": stale,
                          "reprefilled_tokens": 0}
                file.write(json.dumps({"pid": pid, "version": 0, "recomputes_on_update": True, "stale_kv_tokens": 0,
                                       "prefix_cache": counts}) + "\n")
    certificate = certify(tmp_path)
    prefix = certificate["checks"]["caches"]["prefix_cache"]
    assert prefix == {"reused_tokens": 170, "prefilled_tokens": 160, "stale_tokens": 6, "reprefilled_tokens": 0,
                      "hit_rate": round(170 / 330, 4)}
    assert ("    prefix cache: 51.5% of prefill tokens reused (170 reused, 160 computed); 6 held from older weights "
            "and 0 in flight at an update were prefilled again") in describe(certificate)


def test_prefix_caches_that_prefilled_nothing_add_no_line_to_the_summary(tmp_path: Path) -> None:
    """An SFT run's engines generate nothing: a line of zeros would only be noise."""
    folder = tmp_path / "metrics" / "kv_cache"
    folder.mkdir(parents=True)
    (folder / "rollout-0-0.jsonl").write_text(json.dumps({
        "pid": 1, "version": 0, "recomputes_on_update": True, "stale_kv_tokens": 0,
        "prefix_cache": {"reused_tokens": 0, "prefilled_tokens": 0}}) + "\n")
    assert not any("prefix cache" in line for line in describe(certify(tmp_path)))
