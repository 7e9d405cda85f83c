"""The learner's weight publisher against rollout workers that are killed: a real gloo transfer to real worker
processes (`python -m actors.runtime.main`, as the launcher starts them), killed with SIGKILL.

The controller, the buffer and a recording reward actor run in the test's process on real sockets; the publisher
is the learner's (`publisher_for`), fed by its actor's roster the way the learner feeds it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import structlog
import torch

from actors.config import RunConfig
from actors.learner import publish
from actors.learner.publish import WeightPublisher, live_engines, publisher_for
from actors.runtime import chaos
from actors.runtime.base import Actor
from actors.runtime.context import ActorContext, ActorSettings
from actors.runtime.roles import BUILTIN_ROLES
from bus.schema import Roster
from tests.support.gathering import Gathering
from tests.support.inprocess import SLEEPING, ActorSystem, GroupRecorder, actor_system, use_spec, write_prompts
from tools.sim.pipeline import SimSpec

REPO = Path(__file__).resolve().parents[2]
TRANSFER_TIMEOUT_S = 30.0  # what a push would wait for a dead engine if nothing told it the engine was gone


class Pusher(Actor):
    """Holds the learner's publisher and tells it of every roster change, as the learner does; the test pushes."""

    async def on_start(self) -> None:
        # What the trainer yields: its own tensors, or a `Gathering` (fresh copies, counted).
        self.source: Iterable[tuple[str, torch.Tensor]] = [("layer.weight", torch.ones(256, 256)),
                                                            ("layer.bias", torch.ones(256))]
        self.weights: WeightPublisher = publisher_for(
            self.settings.run, self.context.host, engines=lambda: live_engines(self.members("rollout")),
            tensors=lambda: iter(self.source),
            zmq=self.zmq, security=self.security, client_id=f"{self.actor_id}.weights", counters=self.counters,
            log=self.log)

    async def on_roster(self, roster: Roster) -> None:
        self.weights.roster_changed()

    async def on_stop(self) -> None:
        self.weights.close()


ROLES = {"controller": "controller", "buffer": "buffer", "reward": GroupRecorder, "pusher": Pusher}


@pytest.fixture
def workers() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in started:
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()


def _settings(tmp_path: Path) -> dict[str, object]:
    return {**SLEEPING, "weight_transport": "gloo", "weight_transfer_timeout": TRANSFER_TIMEOUT_S,
            "prompt_data": str(write_prompts(tmp_path / "prompts.jsonl")), "rollout_batch_size": 2,
            "n_samples_per_prompt": 2, "rollout_max_batch_size": 2, "rollout_max_response_len": 16,
            "use_tensorboard": False, "plots": False}


def start_worker(system: ActorSystem, run_dir: Path, actor_id: str, started: list[subprocess.Popen[bytes]]
                 ) -> subprocess.Popen[bytes]:
    """A rollout worker process, started the way the launcher starts one."""
    controller = system["controller"]
    run: RunConfig = controller.settings.run
    context = ActorContext(actor_id=actor_id, role="rollout", actor_class=BUILTIN_ROLES["rollout"], node_rank=0,
                           head_address=controller.context.head_address, run_dir=run_dir, heartbeat_interval=0.5,
                           settings=ActorSettings(console_log_level="error", run=run))
    path = run_dir / "actors" / f"{actor_id}-{len(started)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(context.to_json(), encoding="utf-8")
    process = subprocess.Popen([sys.executable, "-m", "actors.runtime.main", str(path)], cwd=REPO,
                               env=os.environ.copy(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started.append(process)
    return process


async def registered(system: ActorSystem, actor_id: str, process: subprocess.Popen[bytes]) -> None:
    """Until the pusher's roster lists `process` alive under `actor_id`."""
    def listed() -> bool:
        member = system["pusher-0-0"].roster.get(actor_id)
        return member is not None and member.alive and member.pid == process.pid

    await system.wait_for(listed, 60, f"{actor_id} (pid {process.pid}) in the roster")


def kill(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=10)


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_a_worker_restarted_under_its_name_gets_the_next_push(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: list[subprocess.Popen[bytes]]) -> None:
    """A restarted process keeps its actor id, so a group keyed on names sent it the generation its predecessor
    had joined, which it could not join ("already joined ... joined twice"), and the push waited out its timeout."""
    use_spec(SimSpec(token_seconds=1e-3, length_min=4, length_max=8), tmp_path, monkeypatch)
    async with actor_system(tmp_path, _settings(tmp_path), ROLES) as system:
        publisher = system["pusher-0-0"].weights
        first = start_worker(system, tmp_path, "rollout-0-0", workers)
        await registered(system, "rollout-0-0", first)
        assert await publisher.publish(1)
        kill(first)
        second = start_worker(system, tmp_path, "rollout-0-0", workers)
        await registered(system, "rollout-0-0", second)
        started = time.monotonic()
        assert await publisher.publish(2), "the restarted worker was not served"
        seconds = time.monotonic() - started
        assert publisher.committed_version == 2
    assert seconds < TRANSFER_TIMEOUT_S / 3, f"the push took {seconds:.1f}s"


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_a_push_to_a_killed_worker_ends_when_the_roster_says_it_died_not_at_the_transfer_timeout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: list[subprocess.Popen[bytes]]) -> None:
    """...and says meanwhile whom it waits for: a push that waited silently hid a dead node for minutes."""
    use_spec(SimSpec(token_seconds=1e-3, length_min=4, length_max=8), tmp_path, monkeypatch)
    monkeypatch.setattr(publish, "WAITING_WARNING_S", 1.0)  # within the 2.5 s the controller takes to see a death
    with structlog.testing.capture_logs() as logs:
        async with actor_system(tmp_path, _settings(tmp_path), ROLES) as system:
            pusher = system["pusher-0-0"]
            survivor = start_worker(system, tmp_path, "rollout-0-0", workers)
            victim = start_worker(system, tmp_path, "rollout-0-1", workers)
            await registered(system, "rollout-0-0", survivor)
            await registered(system, "rollout-0-1", victim)
            assert await pusher.weights.publish(1)
            kill(victim)
            assert pusher.roster["rollout-0-1"].alive, "the roster already knew: the push would not wait at all"
            started = time.monotonic()
            assert await pusher.weights.publish(2), "the survivor was not served"
            seconds = time.monotonic() - started
            assert not pusher.roster["rollout-0-1"].alive
            assert pusher.counters["weights.failed"] == 0
    restarts = [entry for entry in logs if entry["event"] == "weight push restarted without the engines it lost"]
    assert restarts and restarts[0]["lost"] == {"rollout-0-1": "no longer alive"}, restarts
    # On a loaded machine the survivor itself can miss its heartbeat deadline; the controller then declares it
    # dead, it registers again, and the push regroups once more for it. That is the roster at work, not a retry.
    survivor_flaps = [entry for entry in logs if entry["event"] == "member died" and entry["member"] == "rollout-0-0"]
    assert len(restarts) <= 1 + len(survivor_flaps), (restarts, survivor_flaps)
    assert all(set(entry["lost"]) == {"rollout-0-0"} for entry in restarts[1:]), restarts
    assert pusher.counters["weights.restarted"] == len(restarts)
    # The controller declares a member dead after 5 heartbeats of silence (2.5 s here); then one regroup. Each
    # flap of the survivor adds another deadline; all of it far below the transfer timeout the push would wait.
    assert seconds < (6.0 if not survivor_flaps else TRANSFER_TIMEOUT_S / 3), f"the push took {seconds:.1f}s"
    first_attempt = logs[:logs.index(restarts[0])]
    waiting = [entry["engines"] for entry in first_attempt
               if entry["event"] == "weight push waiting on engines" and entry["version"] == 2]
    assert waiting and waiting[-1] == ["rollout-0-1"], waiting  # the survivor is ready by then, the victim never


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_a_worker_killed_after_loading_but_before_answering_ends_the_push_when_the_roster_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: list[subprocess.Popen[bytes]]) -> None:
    """The transfer is complete (every engine acknowledged in the sender's store), but one engine dies before it
    answers its order: the push waited for that answer through all its retries (90 s in a CI run) although the
    roster said within seconds that the engine was gone."""
    use_spec(SimSpec(token_seconds=1e-3, length_min=4, length_max=8), tmp_path, monkeypatch)
    monkeypatch.setenv(chaos.KILL_ENV, "rollout-0-1@weight_load.done#2")  # after it loaded version 2
    async with actor_system(tmp_path, _settings(tmp_path), ROLES) as system:
        pusher = system["pusher-0-0"]
        survivor = start_worker(system, tmp_path, "rollout-0-0", workers)
        victim = start_worker(system, tmp_path, "rollout-0-1", workers)
        await registered(system, "rollout-0-0", survivor)
        await registered(system, "rollout-0-1", victim)
        assert await pusher.weights.publish(1)
        started = time.monotonic()
        assert await pusher.weights.publish(2), "the survivor was not served"
        seconds = time.monotonic() - started
        # Waited for, not polled: on a busy machine the roster may call the victim dead while it still loads, and
        # the push ends before its kill point fires.
        assert await asyncio.to_thread(victim.wait, 30) == -signal.SIGKILL, "the kill point did not fire"
        assert pusher.counters["weights.restarted"] == 1
    assert seconds < 8.0, f"the push took {seconds:.1f}s"


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_a_push_under_way_ends_as_soon_as_the_learner_stops(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: list[subprocess.Popen[bytes]]) -> None:
    """At the end of a run the engines stop too and may never acknowledge the push in hand: a stopping learner
    gives it up at once, or its launcher's grace (15 s) ran out before the learner's checkpoint at stop. Giving
    it up is part of an orderly stop: said at info, not warned about as a failed transfer to be retried."""
    use_spec(SimSpec(token_seconds=1e-3, length_min=4, length_max=8), tmp_path, monkeypatch)
    with structlog.testing.capture_logs() as logs:
        async with actor_system(tmp_path, _settings(tmp_path), ROLES) as system:
            pusher = system["pusher-0-0"]
            engine = start_worker(system, tmp_path, "rollout-0-0", workers)
            await registered(system, "rollout-0-0", engine)
            assert await pusher.weights.publish(1)
            engine.send_signal(signal.SIGSTOP)  # alive to the roster for a while, and never acknowledging
            try:
                push = asyncio.create_task(pusher.weights.publish(2))
                await asyncio.sleep(0.3)
                stopped_at = time.monotonic()
                pusher.weights.stop("the learner is stopping")
                assert await asyncio.wait_for(push, 10) is False
                seconds = time.monotonic() - stopped_at
                assert await pusher.weights.publish(3) is False  # and no push starts after the stop
            finally:
                kill(engine)
    assert seconds < 1.5, f"the push took {seconds:.1f}s to end"
    assert pusher.counters["weights.restarted"] == 0, "the roster ended it, not the stop"
    assert (pusher.counters["weights.given_up_at_stop"], pusher.counters["weights.failed"]) == (1, 0)
    pushes = [entry for entry in logs if entry.get("actor_id") == "pusher-0-0" and "push" in entry["event"]]
    assert [(entry["event"], entry["log_level"], entry["version"]) for entry in pushes
            if entry["log_level"] != "debug"] == [("weights pushed", "info", 1),
                                                   ("weight push given up: the learner is stopping", "info", 2)]


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_a_push_holds_a_gathering_trainers_tensors_a_bucket_at_a_time_and_relearns_changed_specs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: list[subprocess.Popen[bytes]]) -> None:
    """A Megatron learner gathers each tensor's shards as the push iterates: listed before sending, as every push
    was, the whole gathered model was alive at once (140 GB for a 70B model in bf16). The publisher records the
    specs at its first push and streams against them; a model whose specs changed fails one push, which names
    the tensor, and the next push records them again."""
    use_spec(SimSpec(token_seconds=1e-3, length_min=4, length_max=8), tmp_path, monkeypatch)
    with structlog.testing.capture_logs() as logs:
        async with actor_system(tmp_path, _settings(tmp_path), ROLES) as system:
            pusher = system["pusher-0-0"]
            # 2 MiB matrices travel alone (from 1 MiB); 16 of them, each gathered afresh.
            source = Gathering([(f"layers.{i}.weight", torch.full((512, 1024), float(i))) for i in range(16)])
            pusher.source = source
            engine = start_worker(system, tmp_path, "rollout-0-0", workers)
            await registered(system, "rollout-0-0", engine)
            assert await pusher.weights.publish(1) and await pusher.weights.publish(2)
            # in flight, being pulled, and one gloo's worker thread may still hold (see test_weights_stream.py)
            assert source.peak <= 4, f"{source.peak} of 16 gathered tensors alive at once"
            assert source.released_within(5.0), f"{source.alive} gathered tensor(s) outlived the push by 5 s"

            source.model[5] = ("layers.5.weight", torch.zeros(512, 512))
            assert not await pusher.weights.publish(3)
            assert await pusher.weights.publish(4), "the changed specs were not recorded again"
            assert pusher.weights.committed_version == 4
    failed = "weight transfer failed; will retry with the live engines"
    failures = [entry["error"] for entry in logs if entry["event"] == failed]
    assert len(failures) == 1 and "'layers.5.weight'" in failures[0] and "[512, 512]" in failures[0], failures


@pytest.mark.integration
@pytest.mark.timeout(120)
async def test_under_delta_sync_a_push_after_the_first_is_a_delta_and_a_restarted_worker_gets_a_full_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: list[subprocess.Popen[bytes]]) -> None:
    use_spec(SimSpec(token_seconds=1e-3, length_min=4, length_max=8), tmp_path, monkeypatch)
    settings = {**_settings(tmp_path), "weight_delta_sync": True, "weight_delta_backoff": 0}
    async with actor_system(tmp_path, settings, ROLES) as system:
        pusher = system["pusher-0-0"]
        publisher = pusher.weights
        first = start_worker(system, tmp_path, "rollout-0-0", workers)
        await registered(system, "rollout-0-0", first)
        assert await publisher.publish(1)
        pusher.source[0][1][0, :8] += 1.0  # the trainer moved one row's first elements
        assert await publisher.publish(2)
        assert pusher.counters["weights.delta_pushes"] == 1
        kill(first)
        second = start_worker(system, tmp_path, "rollout-0-0", workers)
        await registered(system, "rollout-0-0", second)
        assert await publisher.publish(3)
        assert pusher.counters["weights.delta_pushes"] == 1, "the restarted worker holds nothing to apply a delta to"
        assert await publisher.publish(4)
        assert pusher.counters["weights.delta_pushes"] == 2 and publisher.committed_version == 4


@pytest.mark.unit
def test_delta_sync_with_a_transport_that_sends_every_push_whole_is_refused_at_start() -> None:
    from actors.config import build_config

    config = build_config({"rollout_engine": "sglang", "weight_delta_sync": True, "hf_checkpoint": "model"})
    with pytest.raises(ValueError, match="--weight-delta-sync: the sglang weight transport sends every push whole"):
        publisher_for(config, "127.0.0.1", engines=dict, tensors=lambda: iter(()), zmq=None, security=None,
                      client_id="learner", counters=None, log=None)


@pytest.mark.unit
def test_delta_sync_over_float32_pushes_is_warned_about_at_start() -> None:
    from actors.config import build_config

    log = structlog.get_logger()
    with structlog.testing.capture_logs() as logs:
        publisher_for(build_config({"weight_delta_sync": True, "hf_checkpoint": "model"}), "127.0.0.1",
                      engines=dict, tensors=lambda: iter(()), zmq=None, security=None, client_id="learner",
                      counters=None, log=log)
        publisher_for(build_config({"weight_delta_sync": True, "bf16": True, "hf_checkpoint": "model"}), "127.0.0.1",
                      engines=dict, tensors=lambda: iter(()), zmq=None, security=None, client_id="learner",
                      counters=None, log=log)
    warned = [entry for entry in logs if entry["log_level"] == "warning"]
    assert len(warned) == 1 and "pushes float32 here (no --bf16)" in warned[0]["event"]
