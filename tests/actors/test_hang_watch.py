"""The hang detector's parts: progress counts, wait states, stacks, and the report that names who waits on whom."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from actors.controller.hang import ActorView, HangWatch, hang_report, report_views
from actors.runtime.exits import EXIT_RUN_FAILED, exit_report
from actors.runtime.stacks import dump_stacks
from actors.runtime.waits import MAX_REPORTED, Waits
from bus.schema import Member, StateReport, WaitState
from tests.support.inprocess import actor_system, write_prompts


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def member(actor_id: str, *, alive: bool = True, pid: int = 7) -> Member:
    return Member(actor_id=actor_id, role=actor_id.split("-")[0], node="host#0", pid=pid, endpoints={}, alive=alive)


@pytest.mark.unit
def test_only_a_growing_count_from_the_same_process_is_progress() -> None:
    watch = HangWatch(10.0, now=0.0)
    watch.heartbeat("rollout-0-0", 0, 5, now=1.0)
    assert watch.stalled_for(4.0) == 3.0
    watch.heartbeat("rollout-0-0", 0, 5, now=6.0)  # the same count again: nothing finished
    assert watch.stalled_for(9.0) == 8.0 and not watch.hung(9.0)
    watch.heartbeat("rollout-0-0", 1, 0, now=10.0)  # a restarted process starts from 0: that is not progress
    assert watch.hung(11.0)
    watch.heartbeat("rollout-0-0", 1, 1, now=12.0)  # the new process finished something
    assert watch.stalled_for(12.0) == 0.0


@pytest.mark.unit
def test_a_paused_run_is_not_hung_and_resuming_restarts_the_clock() -> None:
    watch = HangWatch(10.0, now=0.0)
    watch.paused = True
    assert not watch.hung(100.0)
    watch.resume(100.0)
    assert not watch.hung(105.0) and watch.hung(110.0)


@pytest.mark.unit
def test_start_up_has_its_own_limit_and_zero_turns_a_limit_off() -> None:
    watch = HangWatch(5.0, now=0.0, start_timeout_s=60.0)
    assert not watch.hung(30.0, starting=True) and watch.hung(30.0, starting=False)
    assert watch.hung(60.0, starting=True)
    assert not HangWatch(0.0, now=0.0).hung(1e9)


@pytest.mark.unit
def test_waits_are_reported_oldest_first_and_a_repeated_begin_keeps_its_start() -> None:
    clock = Clock()
    waits = Waits(clock)
    waits.begin("work", "buffer", "a lease: none granted (learner version 3)")
    clock.now += 5
    with waits.on("engine", "generating group 0:1"):
        waits.begin("work", "buffer", "a lease: none granted (learner version 4)")
        clock.now += 2
        assert waits.snapshot() == [
            WaitState(on="buffer", what="a lease: none granted (learner version 4)", waited_s=7.0),
            WaitState(on="engine", what="generating group 0:1", waited_s=2.0),
        ]
    waits.end("work")
    assert waits.snapshot() == []


@pytest.mark.unit
def test_a_wait_closes_when_its_block_raises_or_is_cancelled() -> None:
    waits = Waits()

    async def stuck() -> None:
        with waits.on("buffer", "batch 3"):
            await asyncio.sleep(60)

    async def scenario() -> None:
        task = asyncio.create_task(stuck())
        await asyncio.sleep(0.01)
        assert [w.what for w in waits.snapshot()] == ["batch 3"]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    with pytest.raises(ValueError), waits.on("disk", "checkpoint"):
        raise ValueError("disk full")
    assert waits.snapshot() == []


@pytest.mark.unit
def test_a_heartbeat_carries_a_bounded_number_of_waits() -> None:
    waits = Waits()
    for index in range(MAX_REPORTED + 10):
        waits.begin(index, "engine", f"group {index}")
    assert len(waits.snapshot()) == MAX_REPORTED


@pytest.mark.unit
def test_stacks_show_threads_and_the_await_chain_of_each_task() -> None:
    release = threading.Event()
    thread = threading.Thread(target=release.wait, name="collective-that-never-returns", daemon=True)
    thread.start()

    async def waiting_for_the_buffer() -> None:
        await asyncio.sleep(60)

    async def scenario() -> str:
        task = asyncio.create_task(waiting_for_the_buffer(), name="learner.run")
        await asyncio.sleep(0.01)
        try:
            return dump_stacks()
        finally:
            task.cancel()

    text = asyncio.run(scenario())
    release.set()
    assert "--- thread collective-that-never-returns" in text and "in wait" in text
    task_block = text.split("--- task learner.run", 1)[1]
    assert "waiting_for_the_buffer" in task_block and "in sleep" in task_block
    assert len(dump_stacks(limit=200)) < 260


@pytest.mark.unit
def test_the_report_names_the_silent_actor_first_and_every_live_one_with_its_waits() -> None:
    views = report_views(
        [(member("learner", alive=False, pid=4242), 58.0, [WaitState(on="trainer", what="training batch 6")], False),
         (member("rollout-0-0"), 0.4, [WaitState(on="buffer", what="stale", waited_s=1.0)], False),
         (member("reward-0-0", alive=False), 30.0, [], True),  # left on purpose: not a suspect
         (member("buffer"), 0.3, [], False)],
        {"rollout-0-0": StateReport(actor_id="rollout-0-0", waits=[
            WaitState(on="buffer", what="a lease: none granted (learner version 6)", waited_s=55.0)],
            stacks="--- task rollout.run")})
    report = hang_report(62.0, 60.0, views)
    first, *lines = report.summary.splitlines()
    assert first == "no progress for 62 s (--hang-timeout 60); silent: learner"
    assert lines[0].strip().startswith("learner (pid 4242 on host#0): no heartbeat for 58 s")
    assert "training batch 6" in lines[0]
    assert "rollout-0-0: waits for buffer: a lease: none granted (learner version 6) (55 s)" in report.summary
    assert "buffer: waits for nothing it reports (did not answer the state request)" in report.summary
    assert "reward-0-0" not in report.summary
    assert "===== rollout-0-0\n--- task rollout.run" in report.text


@pytest.mark.unit
def test_a_run_that_never_finished_starting_names_the_roles_still_missing() -> None:
    views = [ActorView(member=member("buffer"), silent_s=0.2, waits=[], stacks="")]
    report = hang_report(1800.0, 1800.0, views, missing_roles={"learner": 1, "rollout": 2})
    assert report.summary.splitlines()[0] == ("the run did not finish starting: no actor registered for 1800 s "
                                              "(--start-timeout 1800); never registered: learner x1, rollout x2")


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_an_actor_the_controller_stops_answering_fails_the_run_naming_it(tmp_path: Path) -> None:
    """The controller is the hang detector, so nobody would notice it stop: its actors do, after --hang-timeout."""
    settings = {"prompt_data": str(write_prompts(tmp_path / "prompts.jsonl")), "hang_timeout": 2.0,
                "use_tensorboard": False, "plots": False}
    async with actor_system(tmp_path, settings, {"controller": "controller", "buffer": "buffer"}) as system:
        controller = system["controller"]
        controller.rpc_server.close()  # alive, but answering nothing: as a stopped process would
        silenced = time.monotonic()
        assert await asyncio.wait_for(asyncio.shield(system.tasks["buffer"]), 30) == EXIT_RUN_FAILED
        took = time.monotonic() - silenced
    report = exit_report(system["buffer"].context)
    assert report is not None and report.startswith(f"silent: controller at {controller.context.head_address} "
                                                    "(no heartbeat answered for"), report
    assert took < 2.0 + 3.0, f"the buffer noticed after {took:.1f} s"
