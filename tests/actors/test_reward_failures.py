"""A failing reward function: its failures are logged at a bounded rate, and one that fails on every sample ends
the run with its error, while one that fails now and then never does.

The breaker and rate limit are checked on their own (`RewardFailures`, a settable clock), then in the real
RewardWorker: scoring in process, the whole in-process pipeline (controller, buffer, sleeping rollout worker,
reward worker on real sockets), and a reward worker on another node, which must ask the controller to stop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import structlog
from structlog.testing import capture_logs

from actors.config import build_config
from actors.reward.actor import RewardWorker
from actors.reward.failures import RewardFailures
from actors.runtime.context import ActorContext, ActorSettings
from actors.runtime.exits import EXIT_RUN_FAILED, exit_report
from bus.schema import Sample
from policies.rewards import RewardOutcome
from tests.support.inprocess import SLEEPING, actor_system, use_spec, write_prompts
from tools.sim.pipeline import SimSpec

RAISES = "tests.support.reward_plugins:always_raises"
FLAKY = "tests.support.reward_plugins:fails_unless_ok"
ERROR = RewardOutcome.error("raised ValueError: cannot grade label '7'", trace="Traceback ...\nValueError: ...\n")
OK = RewardOutcome.ok(1.0)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _warnings(logs: list[dict], actor_id: str | None = None) -> list[dict]:
    return [r for r in logs if r["log_level"] == "warning" and actor_id in (None, r.get("actor_id"))]


# ------------------------------------------------------------------------------------------ the policy alone
@pytest.mark.unit
def test_failures_past_the_first_few_are_summarised_once_per_interval_not_logged_one_by_one() -> None:
    clock = Clock()
    with capture_logs() as logs:
        failures = RewardFailures(structlog.get_logger(), "pkg.rm:score", limit=0, first_logged=5,
                                  summary_every_s=10.0, clock=clock)
        for index in range(10_000):  # 10,000 failures over 30 s
            clock.now = index * 0.003
            failures.record(f"g/{index}", ERROR)
        failures.flush()
    one_by_one = [r for r in logs if r["event"] == "reward failed"]
    summaries = [r for r in logs if "failed" in r and r["event"] != "reward failed"]
    assert len(one_by_one) == 5 and all(r["exception"] == ERROR.trace for r in one_by_one)
    assert len(summaries) == 3  # at 10 s, at 20 s, and the rest when flushed
    assert len(logs) == 5 + 1 + 3  # the five, "further failures are summarised", the summaries
    assert summaries[0]["event"].startswith("reward function pkg.rm:score failed ")
    assert "times in the last 10 s; last error: raised ValueError: cannot grade label '7'" in summaries[0]["event"]
    assert 5 + sum(r["failed"] for r in summaries) == 10_000 == failures.total


@pytest.mark.unit
def test_breaker_trips_after_limit_failures_in_a_row_naming_the_function_and_its_last_error() -> None:
    failures = RewardFailures(structlog.get_logger(), "pkg.rm:score", limit=200)
    with capture_logs():
        for index in range(199):
            failures.record(f"g/{index}", ERROR)
        assert failures.tripped is None
        failures.record("g/199", ERROR)
    assert failures.tripped == ("reward function pkg.rm:score failed on 200 samples in a row, none scored "
                                "(--reward-failure-limit 200); last error: raised ValueError: cannot grade label '7'")


@pytest.mark.unit
def test_a_reward_that_fails_often_but_not_always_never_trips_the_breaker() -> None:
    failures = RewardFailures(structlog.get_logger(), "pkg.rm:score", limit=100)
    with capture_logs():
        for index in range(20_000):  # 98% of samples fail; one in 50 is scored
            failures.record(f"g/{index}", OK if index % 50 == 0 else ERROR)
            assert failures.tripped is None
    assert failures.total == 19_600


@pytest.mark.unit
def test_limit_zero_never_trips_and_a_negative_limit_is_refused_by_name() -> None:
    failures = RewardFailures(structlog.get_logger(), "rm", limit=0)
    with capture_logs():
        for index in range(1000):
            failures.record(f"g/{index}", ERROR)
    assert failures.tripped is None
    with pytest.raises(ValueError, match="reward_failure_limit: expected >= 0"):
        RewardFailures(structlog.get_logger(), "rm", limit=-1)


# ------------------------------------------------------------------------------- the worker, in process
def _group(index: int, responses: list[str]) -> list[Sample]:
    return [Sample(sample_id=f"g{index}/{i}", group_id=f"g{index}", index=i, prompt="3+4=", prompt_tokens=1,
                   tokens=np.array([1, 2], dtype=np.int32), response=response, response_length=1, label="7",
                   loss_mask=np.ones(1, dtype=np.int8), status="completed")
            for i, response in enumerate(responses)]


@contextlib.asynccontextmanager
async def _worker(tmp_path: Path, **reward: object) -> AsyncIterator[RewardWorker]:
    """The worker as its process starts it, up to registration (no controller: a head-node worker never calls
    one to fail the run, its exit code does)."""
    context = ActorContext(actor_id="reward-0-0", role="reward", actor_class="actors.reward.actor:RewardWorker",
                           node_rank=0, head_address="tcp://127.0.0.1:1", run_dir=tmp_path, settings={"run": reward})
    worker = RewardWorker(context)
    try:
        await worker.on_start()
        yield worker
    finally:
        worker.zmq.destroy(linger=0)


@pytest.mark.unit
async def test_worker_with_a_flaky_reward_marks_failures_and_keeps_serving_with_few_log_lines(tmp_path: Path) -> None:
    with capture_logs() as logs:
        async with _worker(tmp_path, custom_rm_path=FLAKY, reward_failure_limit=20) as worker:
            for index in range(100):  # 300 of 400 samples fail, never 20 in a row
                scored = await worker.score_samples(_group(index, ["ok", "no", "no", "no"]))
                assert [s.status for s in scored] == ["completed", "failed", "failed", "failed"]
                assert scored[1].error == "reward: raised ValueError: flaky judge: cannot read 'no'"
            assert not worker.stopping and worker.run_failure is None
    assert len(_warnings(logs)) <= 5 + 1 + 1  # the first five, the "summarised" notice, at most one summary


@pytest.mark.unit
async def test_worker_whose_reward_always_raises_stops_after_the_limit_with_the_error(tmp_path: Path) -> None:
    with capture_logs() as logs:
        async with _worker(tmp_path, custom_rm_path=RAISES, reward_failure_limit=20) as worker:
            for index in range(4):
                await worker.score_samples(_group(index, ["a", "b", "c", "d"]))
            assert not worker.stopping  # 16 in a row so far
            await worker.score_samples(_group(4, ["a", "b", "c", "d"]))
            assert worker.stopping
            assert worker.counters["samples.reward_failed"] == 20  # counted before the breaker ends the worker
    reason = f"reward function {RAISES} failed on 20 samples in a row, none scored (--reward-failure-limit 20); " \
             "last error: raised ValueError: cannot grade label '7'"
    assert worker.run_failure == reason
    assert [r["reason"] for r in logs if r["log_level"] == "error"] == [reason]


# --------------------------------------------------------------------------------- real actors and sockets
def _pipeline_settings(tmp_path: Path, **overrides: object) -> dict[str, object]:
    return {**SLEEPING, "prompt_data": str(write_prompts(tmp_path / "prompts.jsonl")), "rollout_batch_size": 2,
            "n_samples_per_prompt": 4, "rollout_max_batch_size": 4, "rollout_max_response_len": 32,
            "use_tensorboard": False, "plots": False, **overrides}


async def pipeline_failed_by(actor_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             **settings: object) -> tuple[Any, Any, list[dict]]:
    """Run the in-process pipeline with `settings` until `actor_id` ends the run as failed (30 s at most); check it
    did so as the launcher expects, saying why once and warning a bounded number of times. Returns the actor, the
    buffer and the logs."""
    use_spec(SimSpec(token_seconds=1e-4, length_min=8, length_max=32), tmp_path, monkeypatch)
    roles = {"controller": "controller", "buffer": "buffer", "reward": "reward", "rollout": "rollout"}
    with capture_logs() as logs:
        async with actor_system(tmp_path, _pipeline_settings(tmp_path, **settings), roles) as system:
            ended = system.tasks[actor_id]
            await asyncio.wait_for(asyncio.shield(ended), 30)
            assert ended.result() == EXIT_RUN_FAILED  # the launcher fails the run on it, no restarts
            worker, buffer = system[actor_id], system["buffer"]
    assert worker.run_failure is not None and exit_report(worker.context) == worker.run_failure  # the launcher's word
    assert len(_warnings(logs, actor_id)) <= 5 + 1 + 1  # not one per failed sample
    assert any(r["event"].startswith("ending the run") and r["reason"] == worker.run_failure for r in logs)
    return worker, buffer, logs


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_pipeline_with_an_always_raising_reward_ends_the_run_as_failed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    worker, _, _ = await pipeline_failed_by("reward-0-0", tmp_path, monkeypatch, custom_rm_path=RAISES,
                                            reward_failure_limit=40)
    assert RAISES in worker.run_failure
    assert "last error: raised ValueError: cannot grade label" in worker.run_failure
    assert worker.counters["samples.reward_failed"] >= 40


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_reward_worker_on_another_node_has_the_controller_abort_the_run(tmp_path: Path) -> None:
    settings = _pipeline_settings(tmp_path, custom_rm_path=RAISES, reward_failure_limit=8)
    async with actor_system(tmp_path, settings, {"controller": "controller"}) as system:
        controller = system["controller"]
        context = ActorContext(actor_id="reward-1-0", role="reward", actor_class="actors.reward.actor:RewardWorker",
                               node_rank=1, head_address=controller.context.head_address, run_dir=tmp_path,
                               heartbeat_interval=0.5,
                               settings=ActorSettings(console_log_level="error", run=build_config(settings)))
        worker = RewardWorker(context)
        ended = asyncio.create_task(worker.main())
        await system.wait_for(lambda: "reward-1-0" in controller.records, 15, "the worker to register")
        for index in range(2):
            await worker.score_samples(_group(index, ["a", "b", "c", "d"]))
        assert await asyncio.wait_for(ended, 20) == EXIT_RUN_FAILED
        # The controller ended the run as failed, so the head's launcher fails too, with the worker's reason.
        assert await asyncio.wait_for(asyncio.shield(system.tasks["controller"]), 20) == EXIT_RUN_FAILED
    assert controller._stop_reason.startswith("abort requested by reward-1-0")  # its connection, by name
    assert controller._stop_reason.endswith(f": reward-1-0: {worker.run_failure}")
