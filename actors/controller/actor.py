"""The controller: who is alive, what state the run is in, and the broadcasts everyone follows.

It sits at the head address. Actors register there and learn the roster (every member's endpoints) and the
broadcast endpoint; heartbeats keep them alive in the registry; a member silent past the deadline is declared
dead and the new roster is broadcast, so peers reconnect or re-lease without asking anyone. The controller
keeps no training state: a restarted controller rebuilds its registry from re-registrations (actors whose
heartbeat it does not recognise register again).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from actors.controller.wandb_mirror import WandbMirror
from actors.runtime.base import Actor
from actors.runtime.handlers import serves
from actors.runtime.metrics import MetricsWriter
from bus import Publisher, RpcServer
from bus.schema import (
    TOPIC_CONTROL,
    TOPIC_ROSTER,
    TOPIC_RUN_STATE,
    TOPIC_VERSION,
    Ack,
    Control,
    Error,
    Heartbeat,
    Leave,
    Member,
    Register,
    Registered,
    Roster,
    RosterEvent,
    RunConfigQuery,
    RunConfigReply,
    RunState,
    VersionAnnouncement,
)
from bus.sockets import peer_name

ACTOR_METRICS_INTERVAL_S = 5.0


@dataclass
class MemberRecord:
    member: Member
    last_seen: float
    connection: str = ""  # the routing id it registered from: its name is bound to that connection
    counters: dict[str, float] = field(default_factory=dict)


class Controller(Actor):
    role = "controller"

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self.heartbeat_deadline = self.settings.heartbeat_deadline or 5 * context.heartbeat_interval
        self.expected: dict[str, int] = dict(self.settings.expected_roles)
        self.records: dict[str, MemberRecord] = {}
        self.generation = 0
        self.publisher: Publisher | None = None
        self.latest_version: VersionAnnouncement | None = None
        self.incarnation = secrets.token_hex(8)

    async def run(self) -> None:
        """Watch liveness until the run stops, and record every actor's counters (queue depths, drops, idle
        fractions) to metrics/actors.jsonl; everything else happens in the request handlers. With --use-wandb
        the metrics files are mirrored into W&B on the same beat (see `actors.controller.wandb_mirror`)."""
        writer = MetricsWriter(self.context.run_dir, "actors")
        mirror = await self._open_wandb_mirror()
        last_written = time.monotonic()
        try:
            while not self.stopping:
                await asyncio.sleep(self.context.heartbeat_interval / 2)
                self._declare_silent_members_dead(time.monotonic())
                if time.monotonic() - last_written >= ACTOR_METRICS_INTERVAL_S:
                    last_written = time.monotonic()
                    version = self.latest_version.version if self.latest_version else 0
                    writer.write(version, {f"{actor_id}/{key}": value for actor_id, record in self.records.items()
                                           if record.member.alive for key, value in record.counters.items()})
                    mirror = await self._advance_wandb(mirror)
        finally:
            writer.close()
            await self._advance_wandb(mirror, closing=True)

    async def _open_wandb_mirror(self) -> WandbMirror | None:
        logging = self.settings.run.logging
        if not logging.use_wandb:
            return None
        try:
            return await asyncio.to_thread(
                WandbMirror, self.context.run_dir, project=logging.wandb_project, group=logging.wandb_group,
                mode=logging.wandb_mode, config=self.settings.run.model_dump(mode="json"),
            )
        except Exception as error:  # W&B is a view of the run, never a reason to stop it
            self.log.warning("W&B disabled: could not start the run", error=repr(error))
            return None

    async def _advance_wandb(self, mirror: WandbMirror | None, *, closing: bool = False) -> WandbMirror | None:
        """Send what the metrics files gained (and finish the W&B run when closing), off the event loop; a
        failure drops the mirror for the rest of the run."""
        if mirror is None:
            return None
        try:
            await asyncio.to_thread(mirror.close if closing else mirror.pump)
            return mirror
        except Exception as error:
            self.log.warning("W&B disabled: mirroring failed; metrics/*.jsonl stay complete", error=repr(error))
            return None

    # The controller is the head: it binds the fixed head address and registers with no one.
    async def start(self) -> None:
        self.rpc_server = RpcServer(self.zmq, self.context.head_address, security=self.security)
        self.publisher = Publisher(self.zmq, self.context.bind_address("publish"), security=self.security)
        self._publish_run_state()
        self.spawn(self.rpc_server.serve(self._dispatch_rpc), name="controller.rpc")
        self.log.info("controller listening", head=self.rpc_server.endpoint, publish=self.publisher.endpoint,
                      expected=self.expected)

    async def stop(self) -> None:
        self._set_state("stopped")
        if self.publisher is not None:
            self.publisher.publish(TOPIC_CONTROL, Control(command="stop", reason=self._stop_reason or "run stopped"))
            await asyncio.sleep(0.2)  # let the last broadcasts leave before the socket closes
            self.publisher.close()
        await super().stop()

    async def _leave(self) -> None:
        return None

    # ------------------------------------------------------------------------------------------ handlers
    @serves(Register)
    async def on_register(self, sender: str, request: Register) -> Registered | Error:
        previous = self.records.get(request.actor_id)
        if previous is not None and self._held_elsewhere(previous, sender):
            # A live process holds this name (a restarted process's predecessor is detached by the time it
            # registers, or within the bus's ZMTP heartbeat timeout): a second claimant waits, it does not replace.
            self._refuse("identity_in_use", request.actor_id, sender)
            return Error(reason="identity_in_use",
                         detail=f"{request.actor_id} is registered by a live connection; retry once it is gone")
        events: list[RosterEvent] = []
        if previous is None:
            events.append(RosterEvent(kind="joined", actor_id=request.actor_id, reason="registered"))
            incarnation = 0
        elif previous.member.alive and previous.member.pid == request.pid:
            incarnation = previous.member.incarnation  # a retried registration of the same process
        else:
            if previous.member.alive:
                # Restarted faster than the heartbeat deadline: the old process is gone all the same, and its
                # peers (the buffer re-issuing its leases) must hear so before they hear of the new one.
                events.append(RosterEvent(kind="died", actor_id=request.actor_id,
                                          reason=f"replaced by a new process (pid {request.pid})"))
            events.append(RosterEvent(kind="returned", actor_id=request.actor_id, reason="registered again"))
            incarnation = previous.member.incarnation + 1
        member = Member(actor_id=request.actor_id, role=request.role, node=request.node, pid=request.pid,
                        endpoints=dict(request.endpoints), alive=True, incarnation=incarnation)
        self.records[request.actor_id] = MemberRecord(member=member, last_seen=time.monotonic(), connection=sender)
        for event in events:
            self.log.info(f"member {event.kind}", member=request.actor_id, role=request.role, node=request.node,
                          pid=request.pid, reason=event.reason)
        if events:
            self._publish_roster(events)
        self._maybe_start_running()
        assert self.publisher is not None
        return Registered(roster=self._roster([]), publish_endpoint=self.publisher.endpoint,
                          heartbeat_interval=self.context.heartbeat_interval, deadline=self.heartbeat_deadline,
                          incarnation=incarnation, controller=self.incarnation)

    @serves(Heartbeat)
    async def on_heartbeat(self, sender: str, request: Heartbeat) -> Ack | Error:
        record = self.records.get(request.actor_id)
        if record is None or not record.member.alive:
            # Unknown (we restarted) or declared dead (it was only slow): it must register again so that
            # its endpoints are current and its return is announced.
            return Error(reason="unknown_actor", detail=f"{request.actor_id} is not registered here")
        if record.connection != sender:
            self._refuse("not_owner", request.actor_id, sender)
            return Error(reason="not_owner", detail=f"{request.actor_id} is registered from another connection")
        record.last_seen = time.monotonic()
        record.counters = dict(request.counters)
        return Ack(ok=True, error=None)

    @serves(Leave)
    async def on_leave(self, sender: str, request: Leave) -> Ack:
        record = self.records.get(request.actor_id)
        if record is not None and record.connection != sender:
            self._refuse("not_owner", request.actor_id, sender)
            return Ack(ok=False, error=f"{request.actor_id} is registered from another connection")
        if record is not None and record.member.alive:
            record.member = _with_alive(record.member, False)
            self._publish_roster([RosterEvent(kind="left", actor_id=request.actor_id, reason=request.reason)])
        return Ack(ok=True, error=None)

    @serves(Control)
    async def on_control_request(self, sender: str, request: Control) -> Ack:
        """Launchers, the learner or an operator ask for pause/resume/drain/stop; everyone hears it."""
        assert self.publisher is not None
        self.log.info("control", command=request.command, reason=request.reason, origin=peer_name(sender))
        self.publisher.publish(TOPIC_CONTROL, request)
        if request.command in ("drain", "stop"):
            self._set_state("draining")
            self.request_stop(f"{request.command} requested by {peer_name(sender)}: {request.reason}")
        return Ack(ok=True, error=None)

    @serves(VersionAnnouncement)
    async def on_version(self, sender: str, request: VersionAnnouncement) -> Ack:
        assert self.publisher is not None
        if not any(r.connection == sender and r.member.alive for r in self.records.values()):
            self._refuse("not_registered", "a version announcement", sender)
            return Ack(ok=False, error="version announcements are taken from registered members only")
        self.latest_version = request
        self.publisher.publish(TOPIC_VERSION, request)
        return Ack(ok=True, error=None)

    @serves(RunConfigQuery)
    async def on_run_config_query(self, sender: str, request: RunConfigQuery) -> RunConfigReply:
        """A worker node's launcher asks before it starts its actors (actors.runtime.head_settings)."""
        return RunConfigReply(settings=self.settings.run.model_dump(mode="json"))

    @serves(RunState)
    async def on_run_state_query(self, sender: str, request: RunState) -> RunState:
        return self._run_state()

    # --------------------------------------------------------------------------------------- internals
    def _held_elsewhere(self, record: MemberRecord, sender: str) -> bool:
        if not record.member.alive or record.connection == sender or self.rpc_server is None:
            return False
        return self.rpc_server.reaches(record.connection)

    def _refuse(self, reason: str, claimed: str, sender: str) -> None:
        """Count a claim on someone else's name; log the first few of each kind, then every 100th."""
        self.counters[f"refused.{reason}"] += 1
        count = self.counters[f"refused.{reason}"]
        if count <= 3 or count % 100 == 0:
            self.log.warning("refused a claim on a registered identity", reason=reason, claimed=claimed,
                             connection=sender, refused_so_far=count)

    def _declare_silent_members_dead(self, now: float) -> None:
        events = []
        for record in self.records.values():
            silent_for = now - record.last_seen
            if record.member.alive and silent_for > self.heartbeat_deadline:
                record.member = _with_alive(record.member, False)
                events.append(RosterEvent(kind="died", actor_id=record.member.actor_id,
                                          reason=f"no heartbeat for {silent_for:.1f}s"))
                self.log.warning("member died", member=record.member.actor_id, silent_s=round(silent_for, 1))
        if events:
            self._publish_roster(events)

    def _roster(self, events: list[RosterEvent]) -> Roster:
        return Roster(generation=self.generation, members=[r.member for r in self.records.values()], events=events)

    def _publish_roster(self, events: list[RosterEvent]) -> None:
        assert self.publisher is not None
        self.generation += 1
        self.publisher.publish(TOPIC_ROSTER, self._roster(events))

    def _maybe_start_running(self) -> None:
        if self.run_state != "starting":
            return
        alive: dict[str, int] = {}
        for record in self.records.values():
            if record.member.alive:
                alive[record.member.role] = alive.get(record.member.role, 0) + 1
        if all(alive.get(role, 0) >= count for role, count in self.expected.items()):
            self._set_state("running")

    def _set_state(self, state: str) -> None:
        if state != self.run_state:
            self.run_state = state
            self.log.info("run state", state=state)
            self._publish_run_state()

    def _run_state(self) -> RunState:
        return RunState(state=self.run_state)

    def _publish_run_state(self) -> None:
        if self.publisher is not None:
            self.publisher.publish(TOPIC_RUN_STATE, self._run_state())


def _with_alive(member: Member, alive: bool) -> Member:
    import msgspec

    return msgspec.structs.replace(member, alive=alive)
