"""The actor base class: one asyncio process with a mailbox, a place in the roster and a heartbeat.

A role subclasses `Actor`, declares handlers with `@handles` / `@serves` / `@on_broadcast` (and a custom actor
the methods others call by name with `@method`), and writes its story in `run()`. The base class owns everything
else: binding the inbound stream and request/reply sockets the handlers need, registering with the controller and
re-registering if the controller forgets us, heartbeats carrying the counters, following roster and control
broadcasts, decoding and dispatch, counting what was dropped and why, and a stop that drains before it closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, ClassVar, TypeVar

import structlog
import zmq.asyncio

from actors.config import CONFIG_ERRORS
from actors.config.policies import POLICY_ROLES
from actors.runtime.context import ActorContext
from actors.runtime.cpu_budget import pin_process
from actors.runtime.exits import (
    ABORTED,
    EXIT_RUN_FAILED,
    RUN_OVER,
    ControllerUnreachable,
    RunOver,
    report_exit,
    report_joined,
)
from actors.runtime.handlers import HandlerTable, collect_handlers
from actors.runtime.host import become_host
from actors.runtime.metrics import MetricsWriter
from actors.runtime.peers import PeerCalls, PeerRpc, PeerStream, alive_members
from actors.runtime.state_report import open_waits, send_state_report
from actors.runtime.stopping import StoppedWhileStarting, unless_stopped
from actors.runtime.waits import Waits
from bus import RpcClient, RpcServer, RpcTimeout, StreamReceiver, Subscriber, schema
from bus.schema import TOPIC_CONTROL, TOPIC_ROSTER, TOPIC_RUN_STATE, Ack, Error

CONTROL_TOPICS = (TOPIC_ROSTER, TOPIC_CONTROL, TOPIC_RUN_STATE)
PeerLink = TypeVar("PeerLink", PeerStream, PeerRpc, PeerCalls)




class Actor:
    """Base of every role. Subclasses set `role` and write `run()`; see the module docstring."""

    role: ClassVar[str] = "custom"
    register_timeout: ClassVar[float] = 60.0
    drain_timeout: ClassVar[float] = 10.0
    run_failure: str | None = None  # why this actor ended the run as failed, once it has (see fail_run)
    _handlers: ClassVar[HandlerTable] = HandlerTable(stream={}, rpc={}, broadcast={})

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._handlers = collect_handlers(cls)

    def __init__(self, context: ActorContext) -> None:
        self.context = context
        self.actor_id = context.actor_id
        self.settings = context.settings
        self.log = structlog.get_logger().bind(actor_id=context.actor_id, role=context.role)
        self.counters: Counter[str] = Counter()
        self.waits = Waits()  # what we wait for and the work we finished, for the controller's hang detector
        self.zmq = zmq.asyncio.Context()
        self.security = self._make_security()
        self.roster: dict[str, schema.Member] = {}
        self.roster_generation = -1
        self.run_state = "starting"
        self.inbox: StreamReceiver | None = None
        self.rpc_server: RpcServer | None = None
        self._controller: RpcClient | None = None
        self._subscriber: Subscriber | None = None
        self._controller_incarnation: str | None = None
        self._peer_links: list[PeerStream | PeerRpc | PeerCalls] = []
        self._calls: dict[str, PeerCalls] = {}  # role -> the link `calls(role)` made
        self._stop_requested = asyncio.Event()
        self._stop_reason = ""
        self._background: set[asyncio.Task[Any]] = set()
        self._heartbeat: asyncio.Task[Any] | None = None
        self._heartbeat_over = asyncio.Event()  # the stop ends the heartbeat (also one that swallowed its cancel)
        self._left = False  # we said goodbye: the controller forgets us on purpose
        self.stream_concurrency: dict[str, int] = {}  # handler name -> override of its declared concurrency
        self._started_at = time.monotonic()

    # ----------------------------------------------------------------------------------------------- story
    async def run(self) -> None:
        """The role's story. The default serves the declared handlers until the run is told to stop."""
        await self._stop_requested.wait()

    async def on_start(self) -> None:
        """Hook: before registration; load engines, create peer links and state. Peers learn our endpoints only
        after it returns, so handlers never run on a half-built actor."""

    async def on_stop(self) -> None:
        """Hook: drain what is in hand (finish or hand back work) before sockets close."""

    async def on_control(self, control: schema.Control) -> None:
        """Hook: pause/resume broadcasts. Stop and drain are handled by the base class."""

    async def on_roster(self, roster: schema.Roster) -> None:
        """Hook: called after each roster update (joins, deaths, returns)."""

    def describe_waits(self) -> list[schema.WaitState]:
        """Hook: waits that are states rather than awaits (the buffer's batch waiting for groups leased to a
        worker), computed when a heartbeat or a hang report asks."""
        return []

    # ----------------------------------------------------------------------------------------- lifecycle
    async def main(self) -> int:
        """Start, run the story, stop. Returns the process exit code: 0 when stopped on purpose."""
        become_host(self)  # the plugins this actor runs reach other actors through it (actors.runtime.host)
        exit_code = 0
        abandoned = False
        try:
            await self._start_unless_stopped()
            story = asyncio.create_task(self.run(), name=f"{self.actor_id}.run")
            stop = asyncio.create_task(self._stop_requested.wait())
            await asyncio.wait({story, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not story.done():
                # Give the story the drain window to notice `self.stopping` and finish its current unit.
                await asyncio.wait({story}, timeout=self.drain_timeout)
            cancelled_here = not story.done()
            if cancelled_here:
                story.cancel()
            try:
                await story
            except asyncio.CancelledError:
                if not cancelled_here and not self.stopping:
                    # A cancellation escaped run() with nobody asking us to stop: exiting 0 would read as "done"
                    # and the launcher would not restart us.
                    raise RuntimeError("run() ended by a stray cancellation") from None
            stop.cancel()
        except StoppedWhileStarting:
            abandoned = True  # nothing started that a stop must drain
        except ControllerUnreachable as error:
            self.log.error("controller unreachable", error=str(error))
            exit_code = 3
        except RunOver as error:
            self._stop_reason = f"controller: {error}"
            self.log.info("run over before this actor joined", reason=str(error))
            if error.failed:
                self.run_failure = f"{ABORTED}the run failed before {self.actor_id} joined it: {error}"
        except CONFIG_ERRORS:
            raise  # not a crash: actors.runtime.main exits EXIT_BAD_CONFIG with the reason, and is not restarted
        except Exception:
            self.log.exception("actor failed")
            exit_code = 1
        finally:
            try:
                if not abandoned:
                    await asyncio.wait_for(self.stop(), self.drain_timeout + 15.0)
            except asyncio.TimeoutError:
                self.log.error("stop did not finish in time; exiting anyway")
        if exit_code == 0 and self.run_failure is not None:
            return report_exit(self.context, self.run_failure, EXIT_RUN_FAILED)  # every launcher fails, none restarts
        return exit_code

    async def _start_unless_stopped(self) -> None:
        """`start()`, given up when a stop is asked for meanwhile. A start-up can take minutes (a model loading,
        an SGLang server coming up, a controller that is gone): SIGTERM then ends the process now, instead of
        after the start-up, or at the launcher's SIGKILL. What on_start began in a thread ends with the process."""
        started, _ = await unless_stopped(self.start(), self._stop_requested)
        if not started:
            self.log.info("stopped while starting", reason=self._stop_reason)
            await self._close_sockets()
            raise StoppedWhileStarting

    async def start(self) -> None:
        """Bind, prepare, then register: a member in the roster is ready to serve its handlers."""
        self._bind_inbound()
        await self.on_start()
        if self.context.cpu_cores:  # after start-up, which loads models on every core (actors.runtime.cpu_budget)
            pin_process(self.context.cpu_cores)
        await self._register()
        self._heartbeat = self._spawn(self._heartbeat_loop())
        self._spawn(self._broadcast_loop())
        if self.inbox is not None:
            self._spawn(self._stream_loop())
        if self.rpc_server is not None:
            self._spawn(self.rpc_server.serve(self._dispatch_rpc))
        self.log.info("actor started", endpoints=self.endpoints())

    def request_stop(self, reason: str) -> None:
        if not self._stop_requested.is_set():
            self._stop_reason = reason
            self.log.info("stop requested", reason=reason)
            self._stop_requested.set()

    @property
    def stopping(self) -> bool:
        return self._stop_requested.is_set()

    async def fail_run(self, reason: str, *, tell_controller: bool = True) -> None:
        """End the whole run as failed with `reason`: the controller aborts every actor on every node (each exits
        EXIT_RUN_FAILED, so each launcher fails with the reason instead of restarting), and this actor stops."""
        if self.run_failure is not None:
            return
        self.run_failure = reason
        self.log.error("ending the run as failed", reason=reason)
        if self._controller is not None and tell_controller:
            try:
                await self._controller.call(schema.Control(command="abort", reason=f"{self.actor_id}: {reason}"),
                                            timeout=5.0, retries=1)
            except Exception as error:  # our own exit still fails this node's launcher, which stops its actors
                self.log.warning("could not ask the controller to abort the run", error=repr(error))
        self.request_stop(reason)

    async def stop(self) -> None:
        """Drain, stop the background loops, say goodbye, close. Every step is bounded in time."""
        try:
            await asyncio.wait_for(self.on_stop(), self.drain_timeout)
        except Exception:
            self.log.exception("on_stop failed")
        # The heartbeat, then the goodbye, then the other loops. A heartbeat answered after our Leave would register
        # us again; and a loop slow to end once cancelled (one waiting on a thread-bound transfer) must not keep us
        # silent past the controller's heartbeat deadline before we said goodbye: we would be recorded as dead.
        if self._heartbeat is not None:
            self._heartbeat_over.set()
            self._heartbeat.cancel()
            await asyncio.wait([self._heartbeat], timeout=1.0)
        await self._leave()
        await self._close_sockets()
        self.log.info("actor stopped", reason=self._stop_reason, counters=dict(self.counters))

    async def _close_sockets(self) -> None:
        """The background loops, then every socket."""
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.wait(list(self._background), timeout=5.0)
        for link in self._peer_links:
            link.close()
        for closable in (self.inbox, self.rpc_server, self._subscriber, self._controller):
            if closable is not None:
                closable.close()
        self.zmq.destroy(linger=0)

    # ------------------------------------------------------------------------------------------- peers
    def peer_stream(self, role: str, endpoint_name: str = "inbox", *, policy: str | None = None) -> PeerStream:
        """A stream to every live member of `role` (of `policy`'s, by default this actor's own for a policy's
        role), kept in step with the roster."""
        return self._follow(PeerStream(self.zmq, sender_id=self.actor_id, role=role, endpoint_name=endpoint_name,
                                       security=self.security, waits=self.waits,
                                       policy=policy or self._own_policy(role)))

    def peer_rpc(self, role: str, endpoint_name: str = "rpc", *, policy: str | None = None) -> PeerRpc:
        """A request/reply client to the live member of `role` (of `policy`'s, by default this actor's own for a
        policy's role), reconnecting when it moves."""
        return self._follow(PeerRpc(self.zmq, client_id=self.actor_id, role=role, endpoint_name=endpoint_name,
                                    security=self.security, waits=self.waits,
                                    policy=policy or self._own_policy(role)))

    def _own_policy(self, role: str) -> str | None:
        """A policy's actor talks to its own policy's buffer, learner and evaluator; a shared actor names one."""
        return self.context.policy if role in POLICY_ROLES else None

    def calls(self, role: str) -> PeerCalls:
        """Calls by method name to the live members of `role` (a custom actor's `@method`s), spread over them; one
        link per role, made on first use and kept."""
        link = self._calls.get(role)
        if link is None:
            link = self._calls[role] = self._follow(PeerCalls(self.zmq, client_id=self.actor_id, role=role,
                                                              endpoint_name="rpc", security=self.security,
                                                              waits=self.waits))
        return link

    def _follow(self, link: PeerLink) -> PeerLink:
        """Point a new peer link at the current roster; every later roster update re-syncs it, stop closes it."""
        link.sync(self.roster)
        self._peer_links.append(link)
        return link

    def members(self, role: str, policy: str | None = None) -> list[schema.Member]:
        return alive_members(self.roster, role, policy or self._own_policy(role))

    def endpoints(self) -> dict[str, str]:
        found = {}
        if self.inbox is not None:
            found["inbox"] = self.inbox.endpoint
        if self.rpc_server is not None:
            found["rpc"] = self.rpc_server.endpoint
        return found

    def open_metrics(self, name: str, *, tensorboard: bool = False) -> MetricsWriter:
        """RUN_DIR/metrics/NAME.jsonl, timed by the run's clock: a restarted actor's records go on from its
        predecessor's time."""
        return MetricsWriter(self.context.run_dir, name, tensorboard=tensorboard,
                             clock_origin=self.settings.clock_origin)

    def spawn(self, coroutine: Coroutine[Any, Any, Any], *, name: str | None = None) -> asyncio.Task[Any]:
        """Run a background task owned by the actor: cancelled at stop, and a crash stops the actor."""
        return self._spawn(coroutine, name=name)

    # --------------------------------------------------------------------------------------- internals
    def _make_security(self) -> Any:
        if self.context.curve_keys_dir is None:
            return None
        from bus.security import Security

        return Security.from_directory(self.context.curve_keys_dir)

    def _bind_inbound(self) -> None:
        if self._handlers.stream:
            self.inbox = StreamReceiver(self.zmq, self.context.bind_address("inbox"),
                                        window=self.settings.stream_window, security=self.security)
        if self._handlers.rpc or self._handlers.methods:
            self.rpc_server = RpcServer(self.zmq, self.context.bind_address("rpc"), security=self.security)

    def _spawn(self, coroutine: Coroutine[Any, Any, Any], *, name: str | None = None) -> asyncio.Task[Any]:
        task = asyncio.create_task(coroutine, name=name)
        self._background.add(task)
        task.add_done_callback(self._on_background_done)
        return task

    def _on_background_done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None and not self.stopping:
            self.log.error("background task crashed", task=task.get_name(), error=repr(error),
                           exc_info=error)
            self.request_stop(f"task {task.get_name()} crashed: {error!r}")

    def registration_facts(self) -> dict[str, Any]:
        """Facts of this role's own that the controller keeps with the member (`Register.meta`); none here."""
        return {}

    def _registration(self) -> schema.Register:
        return schema.Register(actor_id=self.actor_id, role=self.context.role,
                               node=f"{socket.gethostname()}#{self.context.node_rank}", pid=os.getpid(),
                               endpoints=self.endpoints(),
                               meta={"class": self.context.actor_class, **self.registration_facts()},
                               policy=self.context.policy)

    async def _register(self) -> None:
        if self._controller is None:
            self._controller = RpcClient(self.zmq, self.context.head_address, client_id=self.actor_id,
                                         security=self.security)
        deadline = time.monotonic() + self.register_timeout
        while True:
            try:
                reply = await self._controller.call(self._registration(), timeout=2.0, retries=0)
            except RpcTimeout:
                reply = None
            if isinstance(reply, schema.Registered):
                break
            if isinstance(reply, Error) and reply.reason in RUN_OVER:
                raise RunOver(reply.detail, failed=reply.reason == "run_failed")
            if isinstance(reply, Error) and reply.reason != "identity_in_use":
                raise RuntimeError(f"controller refused registration of {self.actor_id}: {reply!r}")
            if time.monotonic() > deadline:
                if reply is None:
                    raise ControllerUnreachable(
                        f"head {self.context.head_address} did not answer for {self.register_timeout:.0f}s")
                raise RuntimeError(f"{self.actor_id}: the controller kept refusing the name for "
                                   f"{self.register_timeout:.0f}s: {reply.detail}")  # type: ignore[union-attr]
            if reply is not None:  # our predecessor's connection is not detached yet: it will be, shortly
                await asyncio.sleep(0.5)
        if reply.controller != self._controller_incarnation:
            if self._controller_incarnation is not None:
                self.log.info("the controller restarted; following the new one", publish=reply.publish_endpoint)
            self._controller_incarnation = reply.controller
            self.roster_generation = -1  # a new controller counts roster generations from 0 again
        await self._apply_roster(reply.roster)
        self._follow_broadcasts(reply.publish_endpoint)
        report_joined(self.context)
        self.log.info("registered", head=self.context.head_address, members=len(self.roster))

    def _follow_broadcasts(self, endpoint: str) -> None:
        """Subscribe to the controller's broadcasts at `endpoint`. A restarted controller publishes on a new port
        (and a new roster generation count): without moving there we would hear no stop, roster or version."""
        if self._subscriber is not None and self._subscriber.endpoints == [endpoint]:
            return
        topics = list(CONTROL_TOPICS) + [t for t in self._handlers.broadcast if t not in CONTROL_TOPICS]
        if self._subscriber is None:
            self._subscriber = Subscriber(self.zmq, endpoint, topics, security=self.security)
            return
        self._subscriber.reconnect(endpoint)

    async def _leave(self) -> None:
        if self._controller is None:
            return
        self._left = True
        with contextlib.suppress(Exception):
            goodbye = schema.Leave(actor_id=self.actor_id, reason=self._stop_reason)
            await asyncio.wait_for(self._controller.call(goodbye, timeout=1.0, retries=0), 2.0)

    async def _heartbeat_loop(self) -> None:
        assert self._controller is not None
        interval = self.context.heartbeat_interval
        sequence = 0
        missed = 0
        answered = time.monotonic()
        # Ended by `_heartbeat_over` as well as by cancellation: a cancel that lands as a reply arrives is swallowed
        # by asyncio.wait_for on Python 3.11, and the loop then slept a whole interval on, holding up every such
        # stop by the 1 s the stop waits for it (one rollout worker's stop in six, ending its run that much later).
        while not self._heartbeat_over.is_set():
            slept, _ = await unless_stopped(asyncio.sleep(interval), self._heartbeat_over)
            if not slept:
                return
            sequence += 1
            await self._fail_if_controller_silent(time.monotonic() - answered)
            try:
                counters = self.metrics()
            except Exception as error:  # a gauge of a half-started role must not stop its heartbeat
                counters = {key: float(value) for key, value in self.counters.items()}
                self.log.debug("metrics unavailable", error=repr(error))
            heartbeat = schema.Heartbeat(actor_id=self.actor_id, seq=sequence, counters=counters,
                                         progress=self.waits.progress, waits=self.wait_states())
            try:
                reply = await self._controller.call(heartbeat, timeout=interval, retries=0)
            except RpcTimeout:
                missed += 1
                self.counters["heartbeat.missed"] += 1
                if missed in (3, 10) or missed % 60 == 0:
                    self.log.warning("controller not answering heartbeats", missed=missed)
                continue
            missed = 0
            answered = time.monotonic()
            if isinstance(reply, Error) and reply.reason == "unknown_actor":
                if self._left:  # a heartbeat that outlived its cancellation at our stop (asyncio.wait_for can
                    return  # swallow one): registering again would put a leaving actor back in the roster
                self.log.warning("controller forgot us; registering again")
                try:
                    await self._register()
                except RunOver as error:
                    self.request_stop(f"controller: {error}")
            elif isinstance(reply, Error) and reply.reason in RUN_OVER:
                self.request_stop(f"controller: {reply.detail}")

    async def _fail_if_controller_silent(self, silent_s: float) -> None:
        """The controller is the hang detector, so nobody else sees it stop (SIGSTOP, a blocked event loop, a lost
        head): an actor it has not answered for --hang-timeout fails the run itself, naming it."""
        limit = self.settings.run.controller.hang_timeout
        if limit and silent_s >= limit and self.run_failure is None:
            await self.fail_run(f"silent: controller at {self.context.head_address} (no heartbeat answered for "
                                f"{silent_s:.0f} s, --hang-timeout {limit:g}): stopped, hung, or unreachable",
                                tell_controller=False)

    def wait_states(self) -> list[schema.WaitState]:
        return open_waits(self.waits, self.describe_waits)

    def metrics(self) -> dict[str, float]:
        """Counters sent with each heartbeat; roles extend this with gauges."""
        found = {key: float(value) for key, value in self.counters.items()}
        # What every socket we bound dropped, by reason and by sender (bus.sockets.DropLog; bounded in size).
        for channel, receiver in {"inbox": self.inbox, "rpc": self.rpc_server}.items():
            if receiver is not None:
                found.update(receiver.drop_metrics(channel))
        found["uptime_s"] = time.monotonic() - self._started_at
        return found

    async def _broadcast_loop(self) -> None:
        assert self._subscriber is not None
        while True:
            topic, message = await self._subscriber.recv()
            if topic == TOPIC_ROSTER and isinstance(message, schema.Roster):
                await self._apply_roster(message)
            elif topic == TOPIC_CONTROL and isinstance(message, schema.Control):
                await self._apply_control(message)
            elif topic == TOPIC_RUN_STATE and isinstance(message, schema.RunState):
                self.run_state = message.state
            handler_name = self._handlers.broadcast.get(topic)
            if handler_name is not None:
                await self._call_handler(handler_name, topic, message)

    async def _apply_roster(self, roster: schema.Roster) -> None:
        if roster.generation <= self.roster_generation:
            return
        self.roster_generation = roster.generation
        self.roster = {member.actor_id: member for member in roster.members}
        for link in self._peer_links:
            link.sync(self.roster)
        for event in roster.events:
            if event.actor_id != self.actor_id:
                self.log.info(f"peer {event.kind}", peer=event.actor_id, reason=event.reason)
        await self.on_roster(roster)

    async def _apply_control(self, control: schema.Control) -> None:
        if control.command in ("stop", "drain"):
            self.request_stop(f"controller: {control.command} ({control.reason})")
        elif control.command == "abort":
            if self.run_failure is None:
                self.run_failure = ABORTED + control.reason
            self.request_stop(f"controller: abort ({control.reason})")
        elif control.command == "report":
            report = send_state_report(self._controller, self.actor_id, self.wait_states(), self.log)
            self.spawn(report, name=f"{self.actor_id}.state-report")
        else:
            await self.on_control(control)

    async def _stream_loop(self) -> None:
        assert self.inbox is not None
        limits: dict[str, asyncio.Semaphore] = {}
        while True:
            sender, message = await self.inbox.recv()
            entry = self._handlers.stream.get(type(message))
            if entry is None:
                self.counters[f"dropped.unhandled.{type(message).__name__}"] += 1
                continue
            name, declared = entry
            concurrency = self.stream_concurrency.get(name, declared)
            if concurrency == 1:
                await self._call_handler(name, sender, message)
                continue
            semaphore = limits.setdefault(name, asyncio.Semaphore(concurrency))
            await semaphore.acquire()
            task = self._spawn(self._call_handler(name, sender, message))
            task.add_done_callback(lambda _task, s=semaphore: s.release())

    async def _dispatch_rpc(self, sender: str, request: Any) -> Any:
        handler: Callable[[str, Any], Awaitable[Any]]
        if isinstance(request, schema.ActorCall) and schema.ActorCall not in self._handlers.rpc:
            name = self._handlers.methods.get(request.method)
            if name is None:
                self.counters["dropped.unknown_method"] += 1
                offered = ", ".join(sorted(self._handlers.methods)) or "none"
                return Error(reason="unknown_method",
                             detail=f"{self.actor_id} has no method {request.method!r} (its methods: {offered})")
            handler = self._method_handler(name)
        else:
            name = self._handlers.rpc.get(type(request))
            if name is None:
                self.counters[f"dropped.unhandled.{type(request).__name__}"] += 1
                return Error(reason="unhandled", detail=f"{self.actor_id} does not serve {type(request).__name__}")
            handler = getattr(self, name)
        try:
            reply = await handler(sender, request)
        except Exception as error:
            self.counters[f"handler_errors.{name}"] += 1
            if self.stopping:  # a request cut short by our own stop (its engine closed under it): no traceback
                self.log.info("request handler ended by the stop", handler=name, sender=sender, error=repr(error))
            else:
                self.log.exception("request handler failed", handler=name, sender=sender)
            return Error(reason="handler_error", detail=f"{type(error).__name__}: {error}")
        return reply if reply is not None else Ack(ok=True, error=None)

    def _method_handler(self, name: str) -> Callable[[str, schema.ActorCall], Awaitable[schema.ActorReply]]:
        """An `@method` as a request handler: the call's arguments in, its return value as the reply."""
        method = getattr(self, name)

        async def answer(sender: str, call: schema.ActorCall) -> schema.ActorReply:
            return schema.ActorReply(result=await method(**call.args))

        return answer

    async def _call_handler(self, name: str, origin: str, message: Any) -> None:
        handler: Callable[[str, Any], Awaitable[None]] = getattr(self, name)
        try:
            await handler(origin, message)
        except Exception:
            # A bad message or a bug in one handler must not take the actor down; it is counted and logged.
            self.counters[f"handler_errors.{name}"] += 1
            self.log.exception("handler failed", handler=name, origin=origin)


