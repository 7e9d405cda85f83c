"""The controller of a run of several policies: the run stops once every policy's learner said it finished, the
others train on meanwhile, and a restarted controller remembers who finished; a stop naming no policy, or an abort,
still ends the run at once; each policy's latest version is recorded in metrics/actors.jsonl.

The real controller on real sockets; the policies' learners are members that say what a learner says.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from actors.config import build_config
from actors.config.policies import ADAPTER_ROOM, ADAPTER_ROOM_WHY
from actors.controller.actor import Controller
from actors.controller.policy_table import PolicyRefused, PolicyTable
from actors.runtime.base import Actor
from actors.runtime.context import ActorContext, ActorSettings
from actors.runtime.metrics import read_metrics
from actors.runtime.roles import BUILTIN_ROLES
from bus import RpcClient
from bus.address import free_port
from bus.schema import Ack, Control, PolicyJoin, PolicyLeave, Roster, VersionAnnouncement
from tests.support.inprocess import HANG_S, ActorSystem, actor_system
from tests.support.policies import start_actor


class Member(Actor):
    """A policy's learner, as far as the controller sees it: it calls the controller and hears its broadcasts."""

    role = "learner"

    def __init__(self, context: ActorContext) -> None:
        super().__init__(context)
        self.heard: list[Control] = []
        self.policies: dict[str, dict] = {}  # the run's policies, as the last roster said

    async def on_roster(self, roster: Roster) -> None:
        self.policies = dict(roster.policies)

    async def on_control(self, control: Control) -> None:
        self.heard.append(control)

    async def tell(self, message: Control | VersionAnnouncement | PolicyJoin | PolicyLeave) -> Ack:
        assert self._controller is not None
        return await self._controller.call(message, timeout=5.0, retries=0)


class RolloutMember(Actor):
    """A rollout worker attached to an SGLang server, as far as the controller sees it: it says the server's
    adapter room when it registers (actors/rollout/lanes.py `adapter_room`)."""

    role = "rollout"

    def registration_facts(self) -> dict[str, object]:
        return {ADAPTER_ROOM: 2, ADAPTER_ROOM_WHY: "SGLang server http://10.0.0.7:30000 (--max-loras-per-batch 5)"}


class OwnEngineMember(Actor):
    """A rollout worker of a policy's own SGLang server with no room for other adapters: not the shared engines'."""

    role = "rollout"

    def registration_facts(self) -> dict[str, object]:
        return {ADAPTER_ROOM: 0, ADAPTER_ROOM_WHY: "SGLang server http://10.0.0.8:30000 (--max-loras-per-batch 1)"}


@contextlib.asynccontextmanager
async def _run(tmp_path: Path) -> AsyncIterator[tuple[ActorSystem, Member, Member]]:
    """A controller of a run of policies "a" and "b", and a learner of each."""
    settings = {"lora_rank": 4, "policies": {"a": {}, "b": {}}}
    async with actor_system(tmp_path, settings, {"controller": "controller"}) as system:
        yield (system, await start_actor(system, "learner", Member, policy="a"),
               await start_actor(system, "learner", Member, policy="b"))


async def _broadcasts_heard(system: ActorSystem, member: Member) -> None:
    """Until `member` heard a pause broadcast sent now: every broadcast published before it has arrived too."""
    heard = len(member.heard)
    assert await member.tell(Control(command="pause", reason="a marker")) == Ack(ok=True, error=None)
    await system.wait_for(lambda: len(member.heard) > heard, HANG_S, "the marker broadcast")


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_the_run_stops_once_every_policy_finished_and_not_before(tmp_path: Path) -> None:
    with capture_logs() as logs:
        async with _run(tmp_path) as (system, a, b):
            controller = system["controller"]
            assert await a.tell(Control(command="stop", reason="trained 3 batches", policy="a")) == Ack(ok=True,
                                                                                                         error=None)
            await _broadcasts_heard(system, b)
            assert not controller.stopping and controller.run_state == "running"
            assert not a.stopping and not b.stopping  # nobody heard a stop: policy b trains on
            assert [control.command for control in b.heard] == ["pause"]

            assert (await b.tell(Control(command="stop", reason="trained 5 batches", policy="b"))).ok
            await system.wait_for(lambda: a.stopping and b.stopping, HANG_S, "the run's stop broadcast")
            assert controller.stopping
    finished = [(r["policy"], r["still_training"]) for r in logs if r["event"] == "policy finished"]
    assert finished == [("a", ["b"]), ("b", [])]
    assert controller._stop_reason == "every policy finished: a: trained 3 batches; b: trained 5 batches"


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_a_stop_for_a_policy_the_run_has_not_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    async with _run(tmp_path) as (system, a, _b):
        refused = await a.tell(Control(command="stop", reason="done", policy="judge"))
        assert refused == Ack(ok=False, error="policy 'judge' is not one of the run's policies (a, b)")
        drain = await a.tell(Control(command="drain", reason="done", policy="a"))
        assert not drain.ok and "only a stop (a policy's learner finished) is per policy" in str(drain.error)
        await _broadcasts_heard(system, a)
        assert not system["controller"].stopping and system["controller"].finished.reasons == {}
        assert [control.command for control in a.heard] == ["pause"]


@pytest.mark.integration
@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", ["stop", "abort"])
async def test_a_stop_naming_no_policy_or_an_abort_ends_a_run_of_policies_at_once(tmp_path: Path,
                                                                                   command: str) -> None:
    async with _run(tmp_path) as (system, a, b):
        assert (await a.tell(Control(command=command, reason="operator"))).ok  # type: ignore[arg-type]
        await system.wait_for(lambda: a.stopping and b.stopping, HANG_S, "the run's stop broadcast")
        assert system["controller"].stopping
        assert (system["controller"].run_failure is not None) == (command == "abort")


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_each_policys_latest_version_is_recorded_beside_the_actors_counters(tmp_path: Path) -> None:
    async with _run(tmp_path) as (system, a, b):
        assert (await a.tell(VersionAnnouncement(version=3, policy="a"))).ok
        assert (await b.tell(VersionAnnouncement(version=1, policy="b"))).ok
        assert (await a.tell(VersionAnnouncement(version=4, policy="a"))).ok
        assert (await b.tell(VersionAnnouncement(version=2, policy="b"))).ok
        controller = system["controller"]
        await system.stop()
        await system.wait_for(lambda: system.tasks["controller"].done(), HANG_S, "the controller to stop")
    (*_, last) = read_metrics(tmp_path / "metrics" / "actors.jsonl")
    assert (last["step"], last["controller/version.a"], last["controller/version.b"]) == (4, 4.0, 2.0)
    assert controller.latest_version.policy == "b"  # the last announced, of either policy


def _controller(run_dir: Path, clock_origin: float) -> Controller:
    """The head's controller of a run of policies "a" and "b", for one start of the run (its clock's origin)."""
    settings = ActorSettings(log_level="warning", console_log_level="error", clock_origin=clock_origin,
                             run=build_config({"lora_rank": 4, "policies": {"a": {}, "b": {}}}))
    return Controller(ActorContext(actor_id="controller", role="controller", actor_class=BUILTIN_ROLES["controller"],
                                   node_rank=0, head_address=f"tcp://127.0.0.1:{free_port()}", run_dir=run_dir,
                                   heartbeat_interval=0.5, settings=settings))


async def _stop_of(controller: Controller, policy: str, reason: str) -> Ack:
    """What a policy's learner sends when it finished, to a controller that is up."""
    while getattr(controller, "publisher", None) is None:  # bound in its start-up's first step
        await asyncio.sleep(0.01)
    client = RpcClient(controller.zmq, controller.context.head_address, client_id=f"learner@{policy}")
    try:
        return await client.call(Control(command="stop", reason=reason, policy=policy), timeout=5.0, retries=0)
    finally:
        client.close()


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_a_restarted_controller_remembers_which_policies_finished_in_this_start_of_the_run(
        tmp_path: Path) -> None:
    """Policy a's learner finished and exited; the controller restarts: it must not wait for a forever. A later
    start of the run (a resume, another clock origin) begins with every policy training."""
    first = _controller(tmp_path, clock_origin=1000.0)
    running = asyncio.create_task(first.main())
    assert (await _stop_of(first, "a", "trained 3 batches")).ok
    first.request_stop("killed")
    assert await running == 0

    restarted = _controller(tmp_path, clock_origin=1000.0)
    running = asyncio.create_task(restarted.main())
    assert restarted.finished.reasons == {"a": "trained 3 batches"} and restarted.finished.training == ["b"]
    assert (await _stop_of(restarted, "b", "trained 5 batches")).ok
    assert await asyncio.wait_for(running, HANG_S) == 0  # ended on its own: every policy finished
    assert restarted._stop_reason == "every policy finished: a: trained 3 batches; b: trained 5 batches"

    assert _controller(tmp_path, clock_origin=2000.0).finished.reasons == {}


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_policies_join_and_leave_the_running_job_and_the_run_ends_when_none_trains(tmp_path: Path) -> None:
    """A join is checked as `policies:` is at start and goes out in the roster; a policy that left has its actors'
    heartbeats answered `policy_left` (they stop) while the others go on; a policy that joined leaves once its
    training finished, and the run ends when no policy in it still trains."""
    async with _run(tmp_path) as (system, a, b):
        controller = system["controller"]
        assert await a.tell(PolicyJoin(policy="c", settings={"lr": 1e-3})) == Ack(ok=True, error=None)
        await system.wait_for(lambda: "c" in b.policies, HANG_S, "the roster naming c")
        assert b.policies == {"a": {}, "b": {}, "c": {"lr": 1e-3}}
        assert (await a.tell(PolicyJoin(policy="c", settings={"lr": 1e-3}))).ok  # asked again: the same policy
        for name, settings, why in (
                ("c", {"lr": 2e-3}, "is in the run already, with other settings"),
                ("d", {"hf_checkpoint": "/elsewhere"}, "policies.d.hf_checkpoint: shared by every policy"),
                ("d", {"lr": "fast"}, "policies.d.lr"),
                ("D-1", {}, "name 'D-1' must be lower-case letters")):
            refused = await a.tell(PolicyJoin(policy=name, settings=settings))
            assert not refused.ok and why in str(refused.error), refused

        assert await a.tell(PolicyLeave(policy="b", reason="done with it")) == Ack(ok=True, error=None)
        await system.wait_for(lambda: b.stopping, HANG_S, "b's actor told its policy left")
        assert "policy b left the run (done with it)" in b._stop_reason and not a.stopping
        again = await a.tell(PolicyLeave(policy="b"))
        assert not again.ok and "it left: done with it" in str(again.error)
        assert a.policies == {"a": {}, "c": {"lr": 1e-3}}

        assert (await a.tell(Control(command="stop", reason="trained 3 batches", policy="a"))).ok
        await _broadcasts_heard(system, a)
        assert not controller.stopping  # c, which joined, still trains
        assert (await a.tell(Control(command="stop", reason="trained 2 batches", policy="c"))).ok
        await system.wait_for(lambda: controller.stopping, HANG_S, "the run's end")
        assert controller.policy_table.left == {"b": "done with it", "c": "its training finished (trained 2 batches)"}


@pytest.mark.unit
def test_the_policy_table_is_kept_for_a_restarted_controller_and_bounded_by_the_engines(tmp_path: Path) -> None:
    config = build_config({"lora_rank": 4, "policies": {"a": {}, "b": {}}})
    table = PolicyTable(config, tmp_path, clock_origin=7.0)
    assert table.join("c", {"lr": 1e-3}) and not table.join("c", {"lr": 1e-3})
    table.leave("a", "asked")
    restarted = PolicyTable(config, tmp_path, clock_origin=7.0)
    assert restarted.live == {"b": {}, "c": {"lr": 1e-3}} and restarted.left == {"a": "asked"}
    assert PolicyTable(config, tmp_path, clock_origin=8.0).live == {"a": {}, "b": {}}  # another start of the run
    with pytest.raises(PolicyRefused, match="this run has one unnamed policy"):
        PolicyTable(build_config({"lora_rank": 4}), tmp_path, None).join("c", {})
    full = PolicyTable(build_config({"lora_rank": 4, "policies": {f"p{i}": {} for i in range(8)}}), tmp_path, None)
    with pytest.raises(PolicyRefused, match="the engines have room for 8 policies' adapters and the run has 8"):
        full.join("late", {})
    assert full.join("own", {"own_engines": 1, "lora_rank": 0})  # its engines are its own: no room taken
    with pytest.raises(PolicyRefused, match=r"the run has 8 \(p0, p1, p2, p3, p4, p5, p6, p7\)"):
        full.join("late", {})


@pytest.mark.integration
@pytest.mark.timeout(60)
async def test_a_join_past_the_adapter_room_a_rollout_worker_said_its_server_has_is_refused(tmp_path: Path) -> None:
    """An attached SGLang server's room is known only to its rollout worker, which says it when it registers: a
    join past it is refused with whose room it is, and taken once a policy left. A policy with engines of its own
    joins past it, and neither it nor its own server's room counts for the others."""
    settings = {"lora_rank": 4, "policies": {"a": {}, "b": {}}, "rollout_engine": "sglang",
                "sglang_url": ["http://10.0.0.7:30000"]}
    async with actor_system(tmp_path, settings, {"controller": "controller"}) as system:
        a = await start_actor(system, "learner", Member, policy="a")
        await start_actor(system, "rollout", RolloutMember, policy=None)
        refused = await a.tell(PolicyJoin(policy="c", settings={}))
        assert not refused.ok and refused.error == (
            "policy 'c' cannot join: rollout-0-0's SGLang server http://10.0.0.7:30000 (--max-loras-per-batch 5) has "
            "room for 2 policies' adapters (each policy's, the one it replaces while a push lands, and the base "
            "model) and the run has 2 (a, b)")
        # a policy with engines of its own joins past the room: it takes none, nor does its own server count
        own = {"own_engines": 1, "lora_rank": 0}
        assert await a.tell(PolicyJoin(policy="own", settings=own)) == Ack(ok=True, error=None)
        await start_actor(system, "rollout", OwnEngineMember, policy="own", joined=own)
        assert (await a.tell(PolicyJoin(policy="c", settings={}))).error == refused.error
        assert (await a.tell(PolicyLeave(policy="b", reason="made room"))).ok
        assert await a.tell(PolicyJoin(policy="c", settings={})) == Ack(ok=True, error=None)
