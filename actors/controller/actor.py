"""The controller: who is alive, what state the run is in, and the broadcasts everyone follows.

It sits at the head address. Actors register there and learn the roster (every member's endpoints) and the
broadcast endpoint; heartbeats keep them alive in the registry; a member silent past the deadline is declared
dead and the new roster is broadcast, so peers reconnect or re-lease without asking anyone. The controller
keeps no training state: a restarted controller rebuilds its registry from re-registrations (actors whose
heartbeat it does not recognise register again). It is also the run's hang detector (actors.controller.hang): a
run in which no actor finished any work for --hang-timeout fails with a report of who waits on whom.

In a run of several policies each policy's learner says when its policy finished (a "stop" naming it); the run
stops once every policy has, and meanwhile the others train on. A stop naming no policy (an operator's, the learner
of a run of one) and an abort end the run at once, as ever.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from actors.controller.finished import FinishedPolicies
from actors.controller.hang import HangWatch, hang_report, report_views
from actors.controller.policy_table import PolicyRefused, PolicyTable
from actors.controller.wandb_mirror import WandbMirror
from actors.runtime.base import Actor
from actors.runtime.handlers import serves
from actors.runtime.metrics import MetricsWriter
from actors.runtime.stopping import unless_stopped
from bus import Publisher, RpcServer, schema
from bus.schema import TOPIC_CONTROL, TOPIC_ROSTER, TOPIC_RUN_STATE, TOPIC_VERSION, Ack, Error, VersionAnnouncement
from bus.sockets import peer_name

ACTOR_METRICS_INTERVAL_S = 5.0
STATE_REPORT_WAIT_S = 5.0  # how long a hang check waits for the actors' state reports
HANG_REPORT_FILE = "hang-report.txt"


@dataclass
class MemberRecord:
    member: schema.Member
    last_seen: float
    connection: str = ""  # the routing id it registered from: its name is bound to that connection
    counters: dict[str, float] = field(default_factory=dict)
    waits: list[schema.WaitState] = field(default_factory=list)  # as of its last heartbeat
    left: bool = False  # it said goodbye (Leave): gone on purpose, not silent
    told_over: bool = False  # a heartbeat of its was answered "run over"; it heard it if it heartbeats no more
    meta: dict[str, Any] = field(default_factory=dict)  # what it said of itself when it registered (Register.meta)


class Controller(Actor):
    role = "controller"

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self.heartbeat_deadline = self.settings.heartbeat_deadline or 5 * context.heartbeat_interval
        self.expected: dict[str, int] = dict(self.settings.expected_roles)
        self.records: dict[str, MemberRecord] = {}
        self.generation = 0
        self.publisher: Publisher | None = None
        self.latest_version: VersionAnnouncement | None = None  # the last announced, of any policy
        self.policy_versions: dict[str, VersionAnnouncement] = {}  # the last of each policy, in a run of several
        self.policy_table = PolicyTable(self.settings.run, context.run_dir, self.settings.clock_origin)
        self.finished = FinishedPolicies(tuple(self.policy_table.live), context.run_dir, self.settings.clock_origin)
        self.incarnation = secrets.token_hex(8)
        limits = self.settings.run.controller
        self.hang = HangWatch(limits.hang_timeout, time.monotonic(), start_timeout_s=limits.start_timeout)
        self.state_reports: dict[str, schema.StateReport] = {}

    async def run(self) -> None:
        """Watch liveness until the run stops, and record every actor's counters (queue depths, drops, idle
        fractions) to metrics/actors.jsonl; everything else happens in the request handlers. With --use-wandb
        the metrics files are mirrored into W&B on the same beat (see `actors.controller.wandb_mirror`)."""
        writer = self.open_metrics("actors")
        mirror = await self._open_wandb_mirror()
        last_written = time.monotonic()
        try:
            while not self.stopping:
                # Woken by a stop too: the launcher's end waits for ours, and a plain sleep made every run's stop
                # wait up to half a heartbeat interval (0.5 s at the default) for this loop to look again.
                await unless_stopped(asyncio.sleep(self.context.heartbeat_interval / 2), self._stop_requested)
                if self.stopping:
                    break
                self._declare_silent_members_dead(time.monotonic())
                if self.hang.hung(time.monotonic(), starting=self.run_state == "starting"):
                    await self._fail_hung_run()
                    break
                if time.monotonic() - last_written >= ACTOR_METRICS_INTERVAL_S:
                    last_written = time.monotonic()
                    self._write_actor_metrics(writer)
                    mirror = await self._advance_wandb(mirror)
        finally:
            self._write_actor_metrics(writer)  # the run's last counters, however short the run
            writer.close()
            await self._advance_wandb(mirror, closing=True)

    def _write_actor_metrics(self, writer: MetricsWriter) -> None:
        """One record of every live actor's counters. Its step is the version, in a run of several policies the
        newest any policy reached (each policy's is the controller's gauge `version.<policy>`)."""
        if self.policy_versions:
            version = max(announced.version for announced in self.policy_versions.values())
        else:
            version = self.latest_version.version if self.latest_version else 0
        writer.write(version, {f"{actor_id}/{key}": value for actor_id, record in self.records.items()
                               if record.member.alive for key, value in record.counters.items()}
                     # our own counters too: the head address and the publisher are bound sockets
                     | {f"{self.actor_id}/{key}": value for key, value in self.metrics().items()})

    async def _open_wandb_mirror(self) -> WandbMirror | None:
        logging = self.settings.run.logging
        if not logging.use_wandb:
            return None
        try:
            return await asyncio.to_thread(
                WandbMirror, self.context.run_dir, project=logging.wandb_project, group=logging.wandb_group,
                mode=logging.wandb_mode, config=self.settings.run.model_dump(mode="json"), run_id=logging.wandb_run_id,
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
        if self.finished.reasons:  # restarted: the learners of these policies finished and are gone
            self.log.info("policies finished before this controller started", finished=self.finished.reasons,
                          still_training=self.finished.training)
            self._stop_once_every_policy_finished()

    async def stop(self) -> None:
        self._set_state("failed" if self.run_failure else "stopped")
        if self.publisher is not None:
            # A failed run is aborted on every node, so every launcher fails with the reason instead of ending well.
            command = "abort" if self.run_failure else "stop"
            self.publisher.publish(TOPIC_CONTROL, schema.Control(command=command, reason=self.run_failure or
                                                                 self._stop_reason or "run stopped"))
            await asyncio.sleep(0.2)  # let the last broadcasts leave before the socket closes
            await self._until_every_member_knows()
            self.publisher.close()
        await super().stop()

    async def _leave(self) -> None:
        return None

    async def _until_every_member_knows(self) -> None:
        """Keep answering until each live member left, or was told by a heartbeat answer that the run is over and
        has not heartbeated for two intervals since. A member that missed the stop broadcast (a subscription not
        yet connected, a frame dropped under load) learns it from its next heartbeat, but only while we still
        answer: without this wait it retried a gone head until its node's --head-loss-timeout, and its node ended
        the finished run as failed. An answer sent is not an answer heard: one that arrives after its sender's
        call timed out is dropped, so a member that heartbeats again did not hear it and is told again (a
        fresh-clone CI run, in-process actors at 0.5 s). At most three heartbeat intervals and a second."""
        interval = self.context.heartbeat_interval
        deadline = time.monotonic() + 3 * interval + 1.0
        while time.monotonic() < deadline:
            now = time.monotonic()
            unaware = [record for actor_id, record in self.records.items() if actor_id != self.actor_id
                       and record.member.alive and not record.left
                       and now - record.last_seen <= self.heartbeat_deadline
                       and not (record.told_over and now - record.last_seen > 2 * interval)]
            if not unaware:
                return
            await asyncio.sleep(0.05)

    def metrics(self) -> dict[str, float]:
        """Ours include what the broadcast publisher dropped (subscriptions that are not, topics too long), and each
        policy's latest version in a run of several."""
        found = super().metrics()
        if self.publisher is not None:
            found.update(self.publisher.drop_metrics("publish"))
        found.update({f"version.{policy}": float(announced.version)
                      for policy, announced in self.policy_versions.items()})
        return found

    # ------------------------------------------------------------------------------------------ handlers
    @serves(schema.Register)
    async def on_register(self, sender: str, request: schema.Register) -> schema.Registered | Error:
        if request.actor_id == self.actor_id:
            # Our own name is never free: a client that took it would be taken for a member (as a "rollout", one
            # the learner waits on for every weight push).
            self._refuse("identity_in_use", request.actor_id, sender)
            return Error(reason="identity_in_use", detail=f"{request.actor_id} is the controller's own name")
        if self.run_state in ("draining", "stopped", "failed"):
            # A late joiner (a worker node that started after the run finished) would never hear the stop that
            # was broadcast before it subscribed, and would wait on a head that is leaving.
            return self._run_over()
        if (policy_over := self._policy_over(request.policy)) is not None:
            return policy_over
        previous = self.records.get(request.actor_id)
        if previous is not None and self._held_elsewhere(previous, sender):
            # A live process holds this name (a restarted process's predecessor is detached by the time it
            # registers, or within the bus's ZMTP heartbeat timeout): a second claimant waits, it does not replace.
            self._refuse("identity_in_use", request.actor_id, sender)
            return Error(reason="identity_in_use",
                         detail=f"{request.actor_id} is registered by a live connection; retry once it is gone")
        events: list[schema.RosterEvent] = []
        if previous is None:
            events.append(schema.RosterEvent(kind="joined", actor_id=request.actor_id, reason="registered"))
            incarnation = 0
        elif previous.member.alive and previous.member.pid == request.pid:
            incarnation = previous.member.incarnation  # a retried registration of the same process
        else:
            if previous.member.alive:
                # Restarted faster than the heartbeat deadline: the old process is gone all the same, and its
                # peers (the buffer re-issuing its leases) must hear so before they hear of the new one.
                events.append(schema.RosterEvent(kind="died", actor_id=request.actor_id,
                                                 reason=f"replaced by a new process (pid {request.pid})"))
            events.append(schema.RosterEvent(kind="returned", actor_id=request.actor_id, reason="registered again"))
            incarnation = previous.member.incarnation + 1
        member = schema.Member(actor_id=request.actor_id, role=request.role, node=request.node, pid=request.pid,
                               endpoints=dict(request.endpoints), alive=True, incarnation=incarnation,
                               policy=request.policy)
        self.records[request.actor_id] = MemberRecord(member=member, last_seen=time.monotonic(), connection=sender,
                                                      meta=dict(request.meta))
        for event in events:
            self.log.info(f"member {event.kind}", member=request.actor_id, role=request.role, node=request.node,
                          pid=request.pid, reason=event.reason)
        if self.run_state == "starting":  # start-up is moving; later, a return is not work done
            self.hang.progressed(time.monotonic())
        if events:
            self._publish_roster(events)
        self._maybe_start_running()
        assert self.publisher is not None
        return schema.Registered(roster=self._roster([]), publish_endpoint=self.publisher.endpoint,
                                 heartbeat_interval=self.context.heartbeat_interval, deadline=self.heartbeat_deadline,
                                 incarnation=incarnation, controller=self.incarnation)

    @serves(schema.Heartbeat)
    async def on_heartbeat(self, sender: str, request: schema.Heartbeat) -> Ack | Error:
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
        record.waits = list(request.waits)
        self.hang.heartbeat(request.actor_id, record.member.incarnation, request.progress, record.last_seen)
        if self.run_state in ("stopped", "failed"):
            # for a member that missed the stop broadcast (it subscribed just after it); while draining, the
            # broadcast is still on its way and says why
            record.told_over = True
            return self._run_over()
        if (policy_over := self._policy_over(record.member.policy)) is not None:
            return policy_over  # its policy left the run: it stops (a learner checkpoints first)
        return Ack(ok=True, error=None)

    def _policy_over(self, policy: str | None) -> Error | None:
        """The answer to an actor of a policy that is not in the run (it left, or never joined), else None."""
        if policy is None or not self.policy_table.several or policy in self.policy_table.live:
            return None
        why = self.policy_table.left.get(policy)
        detail = (f"policy {policy} left the run ({why})" if why is not None else
                  f"policy {policy} is not in the run: join it with launcher.py --join-policy {policy}")
        return Error(reason="policy_left", detail=detail)

    @serves(schema.PolicyJoin)
    async def on_policy_join(self, sender: str, request: schema.PolicyJoin) -> Ack:
        """A policy joins the running job: from the roster that says so, the shared workers generate and score for
        it, and its own actors may register."""
        if self.run_state in ("draining", "stopped", "failed"):
            return Ack(ok=False, error=f"policy {request.policy!r} cannot join: the run is {self.run_state}")
        try:
            rooms = {actor: record.meta for actor, record in self.records.items()  # the shared engines' only
                     if record.member.role == "rollout" and record.member.alive and record.member.policy is None}
            new = self.policy_table.join(request.policy, dict(request.settings), rooms=rooms)
        except PolicyRefused as error:
            self.log.warning("policy join refused", policy=request.policy, error=str(error), origin=peer_name(sender))
            return Ack(ok=False, error=str(error))
        if new:
            self.finished.add(request.policy)
            self.log.info("policy joined", policy=request.policy, settings=dict(request.settings),
                          policies=list(self.policy_table.live), origin=peer_name(sender))
            self._publish_roster([])
        return Ack(ok=True, error=None)

    @serves(schema.PolicyLeave)
    async def on_policy_leave(self, sender: str, request: schema.PolicyLeave) -> Ack:
        """A policy leaves: the shared workers stop generating for it, its own actors stop, and the run goes on with
        the others (it ends here when none is left training)."""
        try:
            self._policy_leaves(request.policy, request.reason, peer_name(sender))
        except PolicyRefused as error:
            return Ack(ok=False, error=str(error))
        return Ack(ok=True, error=None)

    def _policy_leaves(self, policy: str, reason: str, origin: str) -> None:
        self.policy_table.leave(policy, reason)
        self.finished.remove(policy)
        self.log.info("policy left", policy=policy, reason=reason, policies=list(self.policy_table.live),
                      origin=origin)
        self._publish_roster([])
        if not self.policy_table.live:
            self.request_stop(f"every policy left the run (the last, {policy}: {reason})")
        else:
            self._stop_once_every_policy_finished()

    def _run_over(self) -> Error:
        reason = "run_failed" if self.run_state == "failed" else "run_over"
        return Error(reason=reason, detail=f"the run is {self.run_state} ({self._stop_reason or 'no reason given'})")

    @serves(schema.Leave)
    async def on_leave(self, sender: str, request: schema.Leave) -> Ack:
        record = self.records.get(request.actor_id)
        if record is not None and record.connection != sender:
            self._refuse("not_owner", request.actor_id, sender)
            return Ack(ok=False, error=f"{request.actor_id} is registered from another connection")
        if record is not None and record.member.alive:
            record.member = _with_alive(record.member, False)
            record.left = True
            self.log.info("member left", member=request.actor_id, role=record.member.role, node=record.member.node,
                          reason=request.reason)
            self._publish_roster([schema.RosterEvent(kind="left", actor_id=request.actor_id, reason=request.reason)])
        return Ack(ok=True, error=None)

    @serves(schema.Control)
    async def on_control_request(self, sender: str, request: schema.Control) -> Ack:
        """Launchers, the learner or an operator ask for pause/resume/drain/stop; everyone hears it. A policy's
        stop is the controller's alone to hear (`_policy_finished`)."""
        assert self.publisher is not None
        policy = {"policy": request.policy} if request.policy is not None else {}
        self.log.info("control", command=request.command, reason=request.reason, origin=peer_name(sender), **policy)
        if request.policy is not None and request.command == "stop":
            return self._policy_finished(request.policy, request.reason, sender)
        if request.policy is not None and request.command != "abort":  # an abort ends every policy's run at once
            return Ack(ok=False, error=f"Control {request.command!r} names policy {request.policy!r}: only a stop "
                                       "(a policy's learner finished) is per policy")
        self.publisher.publish(TOPIC_CONTROL, request)
        if request.command == "pause":
            self.hang.paused = True
        elif request.command == "resume":
            self.hang.resume(time.monotonic())
        elif request.command == "abort":
            self.run_failure = self.run_failure or request.reason
            self.request_stop(f"abort requested by {peer_name(sender)}: {request.reason}")
        elif request.command in ("drain", "stop"):
            self._set_state("draining")
            self.request_stop(f"{request.command} requested by {peer_name(sender)}: {request.reason}")
        return Ack(ok=True, error=None)

    def _policy_finished(self, policy: str, reason: str, sender: str) -> Ack:
        """A policy's learner finished: the run stops once every policy has, and the others train on till then."""
        try:
            self.finished.finish(policy, reason)
        except KeyError as error:
            self.log.warning("a stop for an unknown policy ignored", policy=policy, origin=peer_name(sender))
            return Ack(ok=False, error=error.args[0])
        self.log.info("policy finished", policy=policy, reason=reason, still_training=self.finished.training)
        if policy in self.settings.run.policies:
            self._stop_once_every_policy_finished()
        else:  # one that joined the running job leaves with its training done: its launcher's actors stop now
            self._policy_leaves(policy, f"its training finished ({reason})", peer_name(sender))
        return Ack(ok=True, error=None)

    def _stop_once_every_policy_finished(self) -> None:
        if self.finished.all_done and self.run_state not in ("draining", "stopped", "failed"):
            self._set_state("draining")
            self.request_stop(f"every policy finished: {self.finished.summary()}")

    @serves(schema.StateReport)
    async def on_state_report(self, sender: str, report: schema.StateReport) -> Ack:
        """An actor's answer to the hang check's "report": what it waits for, and its stacks."""
        record = self.records.get(report.actor_id)
        if record is None or record.connection != sender:
            self._refuse("not_owner", report.actor_id, sender)
            return Ack(ok=False, error=f"{report.actor_id} is not registered from this connection")
        self.state_reports[report.actor_id] = report
        return Ack(ok=True, error=None)

    @serves(VersionAnnouncement)
    async def on_version(self, sender: str, request: VersionAnnouncement) -> Ack:
        assert self.publisher is not None
        if not any(r.connection == sender and r.member.alive for r in self.records.values()):
            self._refuse("not_registered", "a version announcement", sender)
            return Ack(ok=False, error="version announcements are taken from registered members only")
        self.hang.progressed(time.monotonic())
        self.latest_version = request
        if request.policy is not None:
            self.policy_versions[request.policy] = request
        self.publisher.publish(TOPIC_VERSION, request)
        return Ack(ok=True, error=None)

    @serves(schema.RunConfigQuery)
    async def on_run_config_query(self, sender: str, request: schema.RunConfigQuery) -> schema.RunConfigReply:
        """A worker node's launcher asks before it starts its actors (actors.launch.head_settings)."""
        return schema.RunConfigReply(settings=self.settings.run.model_dump(mode="json"))

    @serves(schema.RunState)
    async def on_run_state_query(self, sender: str, request: schema.RunState) -> schema.RunState:
        return self._run_state()

    # --------------------------------------------------------------------------------------- internals
    async def _fail_hung_run(self) -> None:
        """Ask every actor for its waits and stacks, write the report, and fail the run with its summary."""
        stalled = self.hang.stalled_for(time.monotonic())
        self.log.error("no progress; asking every actor what it waits for", stalled_s=round(stalled, 1))
        assert self.publisher is not None
        self.state_reports.clear()
        self.publisher.publish(TOPIC_CONTROL,
                               schema.Control(command="report", reason=f"no progress for {stalled:.0f} s"))
        alive = {actor_id for actor_id, record in self.records.items() if record.member.alive}
        deadline = time.monotonic() + STATE_REPORT_WAIT_S
        while not alive <= set(self.state_reports) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        now = time.monotonic()
        starting = self.run_state == "starting"
        views = report_views([(r.member, now - r.last_seen, r.waits, r.left) for r in self.records.values()],
                             self.state_reports)
        report = hang_report(stalled, self.hang.limit(starting=starting), views,
                             missing_roles=self._missing_roles() if starting else None)
        path = self.context.run_dir / HANG_REPORT_FILE
        try:
            path.write_text(report.text, encoding="utf-8")
            where = f" (full report: {path})"
        except OSError as error:
            where = f" (could not write {path}: {error})"
        self.log.error("the run is hung; failing it" + where, first_line=report.summary.splitlines()[0])
        self.run_failure = f"run hung: {report.summary}{where}"
        self.request_stop("run hung")

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
                events.append(schema.RosterEvent(kind="died", actor_id=record.member.actor_id,
                                                 reason=f"no heartbeat for {silent_for:.1f}s"))
                self.log.warning("member died", member=record.member.actor_id, silent_s=round(silent_for, 1))
        if events:
            self._publish_roster(events)

    def _roster(self, events: list[schema.RosterEvent]) -> schema.Roster:
        members = [record.member for record in self.records.values()]
        policies = self.policy_table.live if self.policy_table.several else {}
        return schema.Roster(generation=self.generation, members=members, events=events, policies=policies)

    def _publish_roster(self, events: list[schema.RosterEvent]) -> None:
        assert self.publisher is not None
        self.generation += 1
        self.publisher.publish(TOPIC_ROSTER, self._roster(events))

    def _maybe_start_running(self) -> None:
        if self.run_state == "starting" and not self._missing_roles():
            self._set_state("running")

    def _missing_roles(self) -> dict[str, int]:
        """Role -> how many of the head's expected actors of it are not registered and alive."""
        alive: dict[str, int] = {}
        for record in self.records.values():
            if record.member.alive:
                alive[record.member.role] = alive.get(record.member.role, 0) + 1
        return {role: count - alive.get(role, 0) for role, count in self.expected.items()
                if alive.get(role, 0) < count}

    def _set_state(self, state: str) -> None:
        if state != self.run_state:
            self.run_state = state
            self.log.info("run state", state=state)
            self._publish_run_state()

    def _run_state(self) -> schema.RunState:
        return schema.RunState(state=self.run_state)

    def _publish_run_state(self) -> None:
        if self.publisher is not None:
            self.publisher.publish(TOPIC_RUN_STATE, self._run_state())


def _with_alive(member: schema.Member, alive: bool) -> schema.Member:
    import msgspec

    return msgspec.structs.replace(member, alive=alive)
