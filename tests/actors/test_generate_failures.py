"""Generation that fails on every sample ends the run, saying why (`--generate-failure-limit`), while generation that
fails now and then, or is cut short by an abort, never does.

Seen through launcher.py: slime's retool generate plugin raised on every sample, the run dropped 16,925 prompt groups
in 300 s and never ended. The breaker is checked on its own, then in the real rollout worker with the whole
in-process pipeline (controller, buffer, reward worker, sleeping engine) on real sockets; the raising plugin through
launcher.py with a real model is tests/system/test_reward_failure_run.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import structlog
from structlog.testing import capture_logs

from actors.config import build_config
from actors.rollout.failures import GenerateFailures, generation_subject
from bus.schema import Sample
from tests.actors.test_reward_failures import pipeline_failed_by
from tests.support.inprocess import write_prompts

PLUGIN = "tests.support.generate_plugins:fails_every_sample"


def _samples(group: str, statuses: list[str]) -> list[Sample]:
    return [Sample(sample_id=f"{group}/{i}", group_id=group, index=i, prompt="1+1=", prompt_tokens=1,
                   tokens=np.array([1], dtype=np.int32), status=status,
                   error="pkg.gen:generate raised KeyError('x')" if status == "failed" else None)
            for i, status in enumerate(statuses)]


def _breaker(limit: int, **flags: object) -> GenerateFailures:
    return GenerateFailures(structlog.get_logger(), build_config({"generate_failure_limit": limit, **flags}))


@pytest.mark.unit
def test_breaker_trips_after_limit_samples_in_a_row_a_raised_group_counting_as_all_of_its_samples() -> None:
    failures = _breaker(20, custom_generate_function_path="pkg.gen:generate")
    with capture_logs() as logs:
        failures.raised("group g0", RuntimeError("sandbox gone"), samples=4)
        for index in range(1, 4):
            failures.record(_samples(f"g{index}", ["failed"] * 4))
        assert failures.tripped is None  # 16 in a row
        failures.raised("group g4", RuntimeError("sandbox gone"), samples=4)
    assert failures.tripped == ("generate function pkg.gen:generate failed on 20 samples in a row, none generated "
                                "(--generate-failure-limit 20); last error: raised RuntimeError('sandbox gone')")
    # One record per failed sample, one per raised group (with its traceback), up to five; then one notice.
    assert [r["event"] for r in logs] == ["generation failed"] * 5 + ["further generation failures are summarised "
                                                                      "every 10 s"]
    assert logs[0]["sample"] == "group g0" and "RuntimeError: sandbox gone" in logs[0]["exception"]
    assert logs[1]["sample"] == "g1/0" and logs[1]["reason"] == "pkg.gen:generate raised KeyError('x')"
    assert all(r["generate_function"] == "generate function pkg.gen:generate" for r in logs)


@pytest.mark.unit
def test_one_generated_sample_starts_the_count_again_and_aborted_ones_count_for_nothing() -> None:
    failures = _breaker(8)
    with capture_logs():
        for index in range(1000):  # 3 of every 4 samples fail, an abort in each group: never 8 in a row
            failures.record(_samples(f"g{index}", ["failed", "aborted", "failed", "completed", "failed"]))
            assert failures.tripped is None
        assert failures.total == 3000 and failures.in_a_row == 1
        failures.record(_samples("h", ["aborted"] * 10 + ["failed"] * 6 + ["truncated"]))  # a truncated answer counts
        assert failures.in_a_row == 0 and failures.tripped is None
    limitless = _breaker(0)
    with capture_logs():
        limitless.raised("group g", ValueError("x"), samples=10_000)
    assert limitless.tripped is None  # 0: never


@pytest.mark.unit
def test_a_negative_limit_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="generate_failure_limit"):
        build_config({"generate_failure_limit": -1})


@pytest.mark.unit
@pytest.mark.parametrize(("flags", "subject"), [
    ({}, "generation (built-in single-turn generate, --rollout-engine torch)"),
    ({"rollout_engine": "sglang"}, "generation (built-in single-turn generate, --rollout-engine sglang)"),
    ({"custom_generate_function_path": "pkg.gen:generate"}, "generate function pkg.gen:generate"),
    ({"agent_function_path": "pkg.agent:solve"}, "agent pkg.agent:solve"),
    ({"agent_tools_path": "pkg.tools:TOOLS"}, "tool loop of --agent-tools-path pkg.tools:TOOLS"),
    ({"rollout_function_path": "pkg.rollout:generate_rollout", "rollout_engine": "sglang"},
     "rollout function pkg.rollout:generate_rollout"),
])
def test_the_breaker_names_what_generates_the_samples(flags: dict[str, object], subject: str) -> None:
    assert generation_subject(build_config(flags)) == subject


# --------------------------------------------------------------------------------- real actors and sockets
@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_pipeline_whose_every_sample_fails_in_generation_ends_the_run_as_failed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The retool run's path: each failed group goes on to the buffer, which drops it and leases the next prompt."""
    worker, buffer, _ = await pipeline_failed_by(
        "rollout-0-0", tmp_path, monkeypatch, custom_generate_function_path=PLUGIN, generate_failure_limit=40,
        max_staleness=100, rollout_max_batch_size=8, prompt_data=str(write_prompts(tmp_path / "many.jsonl", 64)))
    assert worker.run_failure == (f"generate function {PLUGIN} failed on 40 samples in a row, none generated "
                                  "(--generate-failure-limit 40); last error: pkg.retool:generate raised "
                                  "KeyError('tool_call')")
    failed = worker.counters["samples.failed"]  # 40, and the groups of 4 that were generating when it tripped
    assert failed >= 40 and failed % 4 == 0
    assert 1 <= buffer.core.stats.dropped["failed_samples"] <= failed // 4  # the buffer dropped those reaching it
