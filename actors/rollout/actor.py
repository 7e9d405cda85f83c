"""Rollout worker: lease prompt groups from the buffer, generate, send the samples on to the reward workers.

It asks for work only when its engine has room (credit-based pull), so a slow engine never holds prompts
another worker could be generating. Every sample leaves tagged with the per-token policy versions and the
engine's log-probs. Weight updates arrive as orders from the learner and are applied by the engine between
two decode steps, so generation never stops for them.

In a run of several policies the worker generates for each through its own lane (`lanes.py`: the policy's buffer,
versions, leases and adapter); the engine's rows are shared, and the lanes lease in turn so none starves another.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from actors.config.policies import served_elsewhere
from actors.data.prompt_tokens import ImageTokens
from actors.extensions.load import check_rollout_loop, rollout_loop, round_function
from actors.extensions.points import WHOLE_ROUND, RolloutLoop
from actors.rollout.agent import AgentRunner, EpisodeLoop
from actors.rollout.choice import choose_generate_function
from actors.rollout.cross_policy import PolicyTurns, split_by_policy
from actors.rollout.engine_factory import load_engine
from actors.rollout.engine_service import ENGINE_ENDPOINT, EngineService
from actors.rollout.failures import TRANSIENT, unless_aborted
from actors.rollout.generate import GenerateFunction, RolloutContext, groups_calls
from actors.rollout.kv_cache_log import record_kv_cache
from actors.rollout.lanes import Lane, adapter_room, follow_policies, worker_lanes
from actors.rollout.router import STOP_WAIT_S, EngineRouter
from actors.rollout.weights import EngineWeightReceiver
from actors.runtime import chaos
from actors.runtime.base import Actor
from actors.runtime.context import ActorContext
from actors.runtime.handlers import on_broadcast, serves
from actors.runtime.stopping import unless_stopped
from bus.schema import (
    TOPIC_VERSION,
    Ack,
    Error,
    GeneratedGroup,
    Lease,
    LeaseRenew,
    LeaseRequest,
    LostGroups,
    PromptGroup,
    Roster,
    Sample,
    VersionAnnouncement,
    WeightUpdateOrder,
)
from bus.sockets import peer_name
from engines.inference.base import InferenceEngine

WEIGHTS_WAIT_S = 5.0  # how long a new lease waits for weights the buffer will accept its groups from
WEIGHTS_POLL_S = 0.2  # weights too old to train on: how long to wait for a push before asking for pinned work again
IDLE_POLL_S = 0.05  # after "nothing now" from the buffer, ask again this soon unless a version or weights come first
PINNED_WEIGHTS_WAIT_S = 30.0  # how long a group for given weights (PromptGroup.weights_version) waits for them
# The buffer answers a lease request at once, so an attempt that has no answer in a second was lost (a restarting
# buffer, a dropped frame): asked again then, not after 5 s. A retry reuses the request id, so a slow answer is
# still the one taken; the worker gives up after the same 15 s as before, and waits as before for a buffer to
# exist (one restarting) before it asks.
LEASE_ATTEMPT_S, LEASE_RETRIES, BUFFER_WAIT_S = 1.0, 14, 5.0


class RolloutWorker(Actor):
    role = "rollout"
    drain_timeout = 2.0  # unfinished groups are re-issued by the buffer; nothing here is worth waiting for

    def __init__(self, context: ActorContext) -> None:
        """What `on_start` builds exists from here, as None: a worker stopped while its engine loaded closes what it
        has without guessing."""
        super().__init__(context)
        self.engine: InferenceEngine | None = None
        self.engine_service: EngineService | None = None  # our engine, served to the other workers' routers
        self.router: EngineRouter | None = None
        self.weights: EngineWeightReceiver | None = None
        self.generate_fn: GenerateFunction | EpisodeLoop | AgentRunner | None = None
        self.rollout_function: RolloutLoop | None = None
        self.round_function: GenerateFunction | None = None
        self.engine_facts: dict[str, object] = {}

    async def on_start(self) -> None:
        self.config = self.settings.run
        check_rollout_loop(self.config)  # before the engine loads: a refused flag combination fails fast
        self.engine, self.tokenizer = await asyncio.to_thread(load_engine, self.config, self.actor_id)
        self.engine_facts = await adapter_room(self.engine)  # said when it registers: a join is checked on it
        self.image_tokens = ImageTokens.of_run(self.config)  # the image processor loads at the first image prompt
        # a lane per policy it generates for, each leasing from its policy's buffer (lanes.py)
        self.lanes = worker_lanes(self.config, self.context.policy, lambda name: self.peer_rpc("buffer", policy=name),
                                  self.engine, self.log)
        self.retiring: dict[str, asyncio.Task] = {}  # policies that left: their adapters leaving (lanes.py)
        self._turn = 0  # the lane that asks for work first next time
        self.router = self._open_router(self.engine)
        self.rewards = self.peer_stream("reward")
        # The engine's rows are the capacity: eight one-sample eval groups take the room of one eight-sample group.
        self.capacity_rows = max(self.config.engine.rollout_max_batch_size, self.config.rollout.n_samples_per_prompt)
        self.capacity = max(1, self.capacity_rows // self.config.rollout.n_samples_per_prompt)  # in training groups
        self.groups_in_flight = 0
        self.rows_in_flight = 0
        self._room = asyncio.Condition()
        self._idle_since: float | None = time.monotonic()
        self._idle_seconds = 0.0
        self._started = time.monotonic()
        self._slot_seconds = 0.0  # integral of groups in flight over time: what the engine's slots were busy with
        self._slots_since = self._started
        self._send_seconds = 0.0
        self.generate_fn = choose_generate_function(self.config)
        if isinstance(self.generate_fn, AgentRunner):  # the user's agent: it talks to our OpenAI endpoint
            await self.generate_fn.start()
        # slime's --rollout-function-path: the user's generate_rollout leases and generates, this worker sends.
        self.rollout_function = rollout_loop(self)
        self.round_function = round_function(self.config, getattr(self.engine, "url", None))  # --eval-function-path
        if self.rollout_function is not None and len(self.lanes) > 1:
            raise ValueError("--rollout-function-path: a run of several policies (policies:) cannot use a rollout "
                             "function yet; it leases and sends for one policy")
        self.weights = EngineWeightReceiver(self.engine, actor_id=self.actor_id, log=self.log,
                                            plugin=self.config.weights.weight_transport)
        self.spawn(self._renew_leases(), name="rollout.renew")

    def registration_facts(self) -> dict[str, object]:
        """Its engine's adapter room (lanes.py `adapter_room`): the controller refuses a join it has no room for."""
        return self.engine_facts

    def lane_of(self, policy: str | None) -> Lane | None:
        """The lane of `policy`, or on the engine's own weights for None (a run of one, a policy's own engine)."""
        return next((lane for lane in self.lanes if policy in (lane.policy, lane.adapter)), None)

    @property
    def lane(self) -> Lane:
        """The lane of a run of one policy: what the single-policy interface below (a rollout function's) acts on."""
        return self.lanes[0]

    @property
    def held_leases(self) -> dict[str, int]:
        """Every lane's leases still generating (lease id -> groups), for reading."""
        return {lease: groups for lane in self.lanes for lease, groups in lane.held_leases.items()}

    def _open_router(self, engine: InferenceEngine) -> EngineRouter:
        """The router over the run's engines, and our engine served to the others' routers (unless every worker
        keeps to its own engine: --router-policy local)."""
        settings = self.config.router
        if settings.router_policy != "local":
            self.engine_service = EngineService(engine, zmq_context=self.zmq, security=self.security,
                                                bind=self.context.bind_address(ENGINE_ENDPOINT))
            self.spawn(self.engine_service.serve(), name="rollout.engine_service")
        return EngineRouter(engine, local_id=self.actor_id, policy=settings.router_policy,
                            slack=settings.router_load_slack, timeout=settings.router_request_timeout,
                            zmq_context=self.zmq, security=self.security, service=self.engine_service, log=self.log,
                            # another engine whose weights the buffer would not take (its worker restarted and
                            # awaits the learner's next push) refuses our calls rather than generating evictions
                            min_version=self._oldest_accepted, engines_of=self.context.policy)

    def _oldest_accepted(self, adapter: str | None) -> int:
        """The oldest weights of `adapter`'s policy (None: a run of one) its buffer still takes samples of."""
        lane = self.lane_of(adapter)
        return 0 if lane is None else lane.oldest_accepted()

    def endpoints(self) -> dict[str, str]:
        found = super().endpoints()
        if self.engine_service is not None:
            found[ENGINE_ENDPOINT] = self.engine_service.endpoint
        return found

    async def run(self) -> None:
        """lease → generate → send, for as long as the run lasts."""
        if self.rollout_function is not None:
            await self.rollout_function.run()
            return
        while not self.stopping:
            room, _ = await unless_stopped(self._wait_for_room(), self._stop_requested)
            if not room:  # a stop while the engine is full: nothing to drain here (the leases bring the groups back)
                break
            answered, leased = await unless_stopped(self._lease_in_turn(), self._stop_requested)
            if not answered:  # a stop while the buffer has not answered (one that is gone never will): what it
                break  # leases us meanwhile comes back to it when we leave, as the groups of any lease we hold do
            lane, lease = leased
            if lease is None or not lease.groups:
                self._note_no_work(lease, lane)
                if self.groups_in_flight == 0 and (self.engine_service is None or not self.engine_service.load()):
                    await self._hand_over_memory()
                if all(each.weights_too_old() for each in self.lanes):
                    await self._until_set([each.weights_landed for each in self.lanes], WEIGHTS_POLL_S)
                else:  # the poll stays as a backstop: a drop or a re-issue at the buffer opens work unannounced
                    await self._until_set([each.work_may_open for each in self.lanes],
                                          IDLE_POLL_S if lease is not None else 0.5, clear=False)
                continue
            self.waits.end("work")
            self.hold(lease, lane)
            if any(group.weights_version is None for group in lease.groups):  # the others wait for their own
                await self.wait_for_weights_of(lease, lane)
            for group in lease.groups:
                self.generate_group(lease, group, lane)

    async def _lease_in_turn(self) -> tuple[Lane, Lease | None]:
        """A lease for the engine's free rows from the first lane, in turn, that has work: the lane after the one
        served last asks first, so one policy's groups never keep another's out. The last lane's answer when none
        has any."""
        lease: Lease | None = None
        for offset in range(len(self.lanes)):
            lane = self.lanes[(self._turn + offset) % len(self.lanes)]
            lane.work_may_open.clear()
            room = self.capacity_rows - self.rows_in_flight
            # Weights too old to train on get only groups pinned to them (the buffer sees it from weights_version);
            # episodes that feed a policy with no room for them wait (cross_policy.Crossing): owned groups only then.
            held = lane.crossing.held_back({other.policy: other.crossing.room for other in self.lanes}, self.waits)
            lease = await self.request_lease(room, max_samples=room, lane=lane, training=not held)
            if lease is not None and lease.groups:
                self._turn = (self._turn + offset + 1) % len(self.lanes)
                return lane, lease
        return lane, lease

    async def _until_set(self, events: list[asyncio.Event], timeout: float, *, clear: bool = True) -> None:
        """Until one of `events` is set (cleared first with `clear`: only a new one counts), a stop, or `timeout`.
        The stop too: the run's end waits for every worker's, and a poll that slept on through it cost the run up
        to its timeout."""
        if clear:
            for event in events:
                event.clear()
        waiting = [asyncio.ensure_future(event.wait()) for event in [*events, self._stop_requested]]
        try:
            await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waiting:
                task.cancel()

    async def _wait_for_room(self) -> None:
        async with self._room:
            await self._room.wait_for(lambda: self.rows_in_flight < self.capacity_rows)

    async def _hand_over_memory(self) -> None:
        """Nothing to generate: the learner's turn on a device it shares with this engine (a colocated run). A
        release that fails costs only memory, so it is counted and said, and generation goes on."""
        try:
            await self.engine.on_idle()
        except Exception as error:  # the engine's own errors (SglangError: a server that stopped answering)
            self.counters["engine.memory_release_failed"] += 1
            self.log.warning("engine kept its memory: the release failed", error=str(error)[:300])

    def _note_no_work(self, lease: Lease | None, lane: Lane) -> None:
        """Keep one wait open, from the first empty answer on, for the hang report."""
        if lane.weights_too_old():
            whose = "" if lane.policy is None else f" of policy {lane.policy}"
            self.waits.begin("work", "learner", f"weights{whose} newer than version {lane.engine.version} (ours are "
                                                "too old for training groups)")
        elif lease is None:
            self.waits.begin("work", "buffer", "an answer to a lease request")
        else:
            self.waits.begin("work", "buffer", f"a lease: none granted (learner version {lease.version})")

    def weights_too_old(self, lane: Lane | None = None) -> bool:
        """Our weights are older than anything the buffer would accept: wait for the learner's push instead of
        generating samples that would be evicted. That is the case after a restart, and in a synchronous run from
        the moment the learner announces a version until its weights land here: leasing on the announcement
        generated whole groups with the previous weights, evicted as one version stale. A learner that never
        pushes (--debug-rollout-only: its announcements carry no weights version) has nothing to wait for."""
        return (lane or self.lane).weights_too_old()

    async def wait_for_weights_of(self, lease: Lease, lane: Lane) -> None:
        """A lease is admitted at the buffer's version, which may have heard the learner's announcement before we
        did: generate with weights the batch can take, waiting for them a bounded while (the buffer's check at
        consumption stays the backstop, and a learner that restarted lower must not stall us)."""
        if not lane.versions.learner_pushes:
            return
        lane.versions.leased_at(lease.version)
        deadline = time.monotonic() + WEIGHTS_WAIT_S
        while lane.weights_too_old() and not self.stopping and time.monotonic() < deadline:
            await self.wait_for_weights(0.2, lane)

    async def wait_for_pinned_weights(self, group: PromptGroup, lane: Lane) -> None:
        """A group for weights v (an eval round's, `PromptGroup.weights_version`) is generated with v's weights. Its
        owner asked the learner to pin the engines on v, so they stay there until it is done; a worker that joined
        or restarted since may not have them yet. Weights that never come do not stall the group past a
        deadline."""
        version = group.weights_version
        if version is None or not lane.versions.learner_pushes:
            return
        deadline = time.monotonic() + PINNED_WEIGHTS_WAIT_S
        while lane.engine.version < version and not self.stopping and time.monotonic() < deadline:
            await self.wait_for_weights(0.2, lane)
        if lane.engine.version != version:
            self.counters["groups.off_pinned_weights"] += 1
            self.log.warning("group generated with other weights than those it was pinned to",
                             group=group.group_id, weights_version=version, engine_version=lane.engine.version)

    async def wait_for_weights(self, timeout: float, lane: Lane | None = None) -> None:
        """Until the next weight update of the lane's policy lands here, or `timeout` (a push may have landed before
        we asked)."""
        await self._until_set([(lane or self.lane).weights_landed], timeout)

    def hold(self, lease: Lease, lane: Lane | None = None) -> None:
        """Count a new lease's groups as in flight, and renew the lease until each is released."""
        self._mark_busy(len(lease.groups), sum(group.n_samples for group in lease.groups))
        (lane or self.lane).held_leases[lease.lease_id] = len(lease.groups)

    def generate_group(self, lease: Lease, group: PromptGroup, lane: Lane | None = None) -> None:
        self.spawn(self._rollout_group(lease, group, lane or self.lane), name=f"rollout.{group.group_id}")

    async def _rollout_group(self, lease: Lease, group: PromptGroup, lane: Lane) -> None:
        try:
            await self.wait_for_pinned_weights(group, lane)
            # Another role's group (an eval round's) is generated by the engine whose weights it asked for: ours.
            key = group.group_id if groups_calls(self.generate_fn) else None
            engine = self.engine if group.owner is not None or self.router is None else self.router.engine_for(key)
            context = RolloutContext(engine=lane.view(engine), tokenizer=self.tokenizer, config=lane.config,
                                     worker_id=self.actor_id, policy=lane.policy, image_tokens=self.image_tokens,
                                     policy_engines={other.policy: other.view(engine) for other in self.lanes
                                                     if other.policy is not None},
                                     policy_configs={other.policy: other.config for other in self.lanes
                                                     if other.policy is not None},
                                     policies_elsewhere=served_elsewhere(
                                         self.config.policies, [other.policy for other in self.lanes],
                                         own_engine=lane.own_engine))
            with self.waits.on("engine", f"generating group {group.group_id}"):
                generate = self.round_function if WHOLE_ROUND in group.metadata else self.generate_fn
                try:
                    samples = await chaos.during("generate.mid", generate(context, group))
                    samples = await unless_aborted(generate, context, group, samples, worker=self)
                except Exception as error:
                    if self.stopping or isinstance(error, TRANSIENT):
                        raise  # said below; not a failure of the function's (the lease brings the group back)
                    await self.generation_raised(f"group {group.group_id}", error, samples=group.n_samples, lane=lane)
                    return  # not sent: its lease runs out and the buffer gives the group out again
            if samples is None:
                return  # not sent: its lease runs out and the buffer gives the group out again
            self._note_context_cuts(context, group)
            samples, others = split_by_policy(context, group, samples)
            await self.send_generated(lease.lease_id, group.group_id, samples, is_eval=group.is_eval,
                                      eval_set=group.eval_set, lane=lane)
            await self._send_other_policies(lease.lease_id, group, others, lane)
            self.waits.made_progress()
        except asyncio.CancelledError:
            raise
        except Exception as error:
            # The lease will expire and the group be re-issued; say what happened instead of dying.
            self.counters["groups.failed"] += 1
            self.log.exception("rollout of a group failed", group=group.group_id, error=repr(error))
        finally:
            await self.release(lease.lease_id, group, lane)

    def _note_context_cuts(self, context: RolloutContext, group: PromptGroup) -> None:
        """A group whose responses the context cap cut short: the first is a warning, the rest are counted."""
        if not context.context_cuts:
            return
        self.counters["groups.max_new_tokens_cut"] += 1
        say = self.log.warning if self.counters["groups.max_new_tokens_cut"] == 1 else self.log.info
        say(f"{context.context_cuts[0]}: its responses may end truncated (later groups cut so are counted as "
            "groups.max_new_tokens_cut)", group=group.group_id, data_index=group.data_index)

    async def send_generated(self, lease_id: str, group_id: str, samples: list[Sample], *,
                             is_eval: bool = False, eval_set: str | None = None, lane: Lane | None = None
                             ) -> None:
        """Hand one generated group to the reward workers, counting what was generated."""
        lane = lane or self.lane
        self.counters["samples.generated"] += len(samples)
        # A failed sample (an episode that raised, a prompt over the context cap): the buffer leaves it out (or drops
        # the group), counted; and so many in a row that the function must be broken end the run.
        self.counters["samples.failed"] += sum(s.status == "failed" for s in samples)
        lane.failures.record(samples)
        self.counters["tokens.generated"] += int(sum(s.response_length for s in samples))
        handed = time.monotonic()
        reward_worker = await self.rewards.send(GeneratedGroup(lease_id=lease_id, group_id=group_id,
                                                               samples=samples, worker_id=self.actor_id,
                                                               is_eval=is_eval, eval_set=eval_set,
                                                               policy=lane.policy))
        self._send_seconds += time.monotonic() - handed  # a long wait here is a back-pressured reward stream
        self.counters["groups.sent"] += 1
        lane.handed_off.note(reward_worker, lease_id, group_id)
        await self._end_if_failing(lane)  # once sent: the buffer accounts for the group that tripped it too

    async def generation_raised(self, item: str, error: Exception, *, samples: int, lane: Lane | None = None) -> None:
        """`item` (a group, a rollout function's call) lost `samples` samples to `error`: counted and logged (the
        first few with their traceback), and the run ended once --generate-failure-limit of them are in a row."""
        lane = lane or self.lane
        self.counters["groups.failed"] += 1
        lane.failures.raised(item, error, samples=samples)
        await self._end_if_failing(lane)

    async def _end_if_failing(self, lane: Lane) -> None:
        tripped = lane.failures.tripped
        if tripped is not None:  # a worker restarted would fail the same way: the run fails, with the reason
            await self.fail_run(tripped if lane.policy is None else f"policy {lane.policy}: {tripped}")

    async def _send_other_policies(self, lease_id: str, group: PromptGroup, others: list[PolicyTurns],
                                   lane: Lane) -> None:
        """Each other policy's group in `group`'s episode to that policy's reward and buffer. The reward worker it
        goes to holds the host group too: if it dies while the host group is still unscored, the host's buffer gives
        the group out again, and the episode, every policy's turns in it, is generated again. An eval round's
        episode trains no policy."""
        if group.is_eval:
            self.counters["other_policy_groups.eval_unsent"] += len(others)
            return
        for turns in others:
            self.counters["samples.generated"] += len(turns.samples)
            reward_worker = await self.rewards.send(GeneratedGroup(
                lease_id=lease_id, group_id=turns.group.group_id, samples=turns.samples, worker_id=self.actor_id,
                policy=turns.policy, host_group=group.group_id))
            self.counters["other_policy_groups.sent"] += 1
            lane.crossing.fed.add(turns.policy)
            lane.handed_off.note(reward_worker, lease_id, group.group_id)

    async def release(self, lease_id: str, group: PromptGroup, lane: Lane | None = None) -> None:
        """`group` of `lease_id` is done with (sent or given up): free its rows; the last one ends renewal."""
        async with self._room:
            self._mark_busy(-1, -group.n_samples)
            self._room.notify_all()
        held = (lane or self.lane).held_leases
        remaining = held.get(lease_id, 1) - 1
        if remaining <= 0:
            held.pop(lease_id, None)
        else:
            held[lease_id] = remaining

    def _mark_busy(self, delta: int, rows: int) -> None:
        """Track the time with nothing to generate: the rollout idle fraction a user tunes staleness against."""
        now = time.monotonic()
        self._slot_seconds += self.groups_in_flight * (now - self._slots_since)
        self._slots_since = now
        if self._idle_since is not None and delta > 0:
            self._idle_seconds += now - self._idle_since
            self._idle_since = None
        self.groups_in_flight += delta
        self.rows_in_flight += rows
        if self.groups_in_flight == 0 and self._idle_since is None:
            self._idle_since = now

    def busy_slot_seconds(self) -> float:
        """Seconds of group slots in flight (generating or handing to the reward stream), summed over slots and
        cumulative: a reader takes the difference over its own window and divides by slots x window length."""
        return self._slot_seconds + self.groups_in_flight * (time.monotonic() - self._slots_since)

    def idle_fraction(self) -> float:
        now = time.monotonic()
        idle = self._idle_seconds + (now - self._idle_since if self._idle_since is not None else 0.0)
        return idle / max(now - self._started, 1e-9)

    async def request_lease(self, max_groups: int, *, max_samples: int | None = None, lane: Lane | None = None,
                            training: bool = True) -> Lease | None:
        """Groups from the lane's buffer, for weights of the version its policy's adapter has on our engine."""
        lane = lane or self.lane
        try:
            request = LeaseRequest(worker_id=self.actor_id, max_groups=max_groups, training=training,
                                   weights_version=lane.engine.version, max_samples=max_samples,
                                   holds_none=not lane.leased_before)
            reply = await lane.buffer.call(request, timeout=LEASE_ATTEMPT_S, retries=LEASE_RETRIES,
                                           member_wait=BUFFER_WAIT_S)
        except (TimeoutError, asyncio.TimeoutError, ConnectionError) as error:
            self.counters["lease.unanswered"] += 1
            self.log.warning("buffer did not answer a lease request", error=str(error))
            return None
        if not isinstance(reply, Lease):
            self.log.warning("unexpected lease reply", reply=repr(reply)[:200])
            return None
        lane.leased_before = True
        lane.crossing.room = reply.adoption_room
        return reply

    async def _renew_leases(self) -> None:
        interval = max(0.5, self.config.buffer.lease_timeout / 3)
        while True:
            await asyncio.sleep(interval)
            for lane in list(self.lanes):
                for lease_id in list(lane.held_leases):
                    with contextlib.suppress(Exception):
                        await lane.buffer.call(LeaseRenew(lease_id=lease_id), timeout=2.0, retries=0)

    @on_broadcast(TOPIC_VERSION)
    async def on_version(self, topic: str, announcement: VersionAnnouncement) -> None:
        lane = self.lane_of(announcement.policy)
        if lane is None:  # another run's shape: a policy this worker does not generate for
            return
        lane.versions.heard(announcement.version, announcement.weights_version)
        lane.work_may_open.set()

    @serves(WeightUpdateOrder)
    async def on_weight_update(self, sender: str, order: WeightUpdateOrder) -> Ack | Error:
        """Join the learner's broadcast and load the new weights in place (into the adapter of the learner's policy,
        in a run of several); the reply is the acknowledgement."""
        lane = self.lane_of(order.adapter)
        if lane is None:
            return Error(reason="weight_transfer", detail=f"{self.actor_id} generates for no policy {order.adapter!r} "
                                                          f"(its policies: {[lane.policy for lane in self.lanes]})")
        chaos.reached("weight_load.start")
        try:
            with self.waits.on(peer_name(sender), f"the weights of version {order.version} (generation paused)"):
                await self.weights.apply(order)
        except Exception as error:
            from engines.weights.base import WeightTransferError  # torch is loaded by now: a transfer ran

            if not isinstance(error, WeightTransferError):
                raise
            # Expected when the learner gives a push up (a member died, the run stops): said, not a traceback; and
            # not warned about when this worker is stopping too, which is how a run ends.
            self.counters["weights.failed"] += 1
            report = self.log.info if self.stopping else self.log.warning
            report("weight update given up", version=order.version, error=str(error))
            return Error(reason="weight_transfer", detail=str(error))
        chaos.reached("weight_load.done")
        self.counters["weights.updates"] += 1
        # the certificate's account of this engine's cache
        record_kv_cache(self.context.run_dir, self.actor_id, self.engine, order.version, self.settings.clock_origin)
        lane.weights_landed.set()  # a worker waiting for these weights starts generating now
        lane.work_may_open.set()
        return Ack(ok=True, error=None)

    def metrics(self) -> dict[str, float]:
        found = super().metrics()
        if self.engine is not None:
            found["engine.version"] = float(self.engine.version)
            for lane in self.lanes:
                if lane.policy is not None:  # each policy's adapter's, and its episodes held back
                    found[f"engine.version.{lane.policy}"] = float(lane.engine.version)
                    found.update(lane.crossing.metrics(lane.policy))
            found["engine.memory_releases"] = float(self.engine.memory_releases)  # colocated turns
            found["rollout.groups_in_flight"] = float(self.groups_in_flight)
            found["rollout.idle_fraction"] = self.idle_fraction()
            found["rollout.busy_slot_seconds"] = self.busy_slot_seconds()
            found["rollout.capacity_groups"] = float(self.capacity)
            found["rollout.send_seconds"] = self._send_seconds
            prefix_cache = self.engine.prefix_cache_stats()  # engine.prefix_cache.*: hit rate, reused and prefilled
            if prefix_cache is not None:
                found.update(prefix_cache.metrics())
        if self.router is not None:  # router.*: where our calls went, per engine
            found.update(self.router.metrics())
        if self.engine_service is not None:  # engine.served_*: the other workers' calls our engine answered
            found.update(self.engine_service.metrics())
        if self.rollout_function is not None:
            found.update(self.rollout_function.metrics())
        return found

    async def on_roster(self, roster: Roster) -> None:
        """The router follows the engines in the roster. A reward worker that died took the groups we handed it:
        tell the buffer now, so it re-issues them at once instead of when their leases expire (the buffer sees no
        lease of a reward worker's)."""
        if self.router is not None:
            self.router.sync(self.roster)
        await follow_policies(self, roster.policies)
        for event in roster.events:
            member = self.roster.get(event.actor_id)
            if event.kind not in ("died", "left") or member is None or member.role != "reward":
                continue
            for lane in self.lanes:
                await self._report_lost(lane, event.actor_id, f"{event.actor_id} {event.kind} ({event.reason}) before "
                                                              "scoring them")

    async def _report_lost(self, lane: Lane, reward_worker: str, reason: str) -> None:
        """Tell the lane's buffer which of its groups went with `reward_worker`."""
        lost = lane.handed_off.lost_with(reward_worker)
        if not lost:
            return
        try:
            await lane.buffer.call(LostGroups(lease_ids=[lease for lease, _ in lost],
                                              group_ids=[group for _, group in lost], reason=reason),
                                   timeout=5.0, retries=2)
        except Exception as error:  # the leases still expire: late, but nothing is lost
            report = self.log.info if self.stopping else self.log.warning  # at a stop the buffer may be gone
            report("could not report groups lost with a reward worker", reward=reward_worker,
                   groups=len(lost), error=repr(error))

    async def on_stop(self) -> None:
        """In this order: the agents' episodes cancelled (no call reaches the engine after its abort), other
        workers' calls refused from now on, the engine's requests aborted (ours and those it serves, whose callers
        move them to another engine once the answers say we stop) and our calls on other engines too, the agents'
        endpoint stopped (it waits for its calls, which the abort ended), the engine closed. The endpoint stopped
        before the abort waited on calls that only the abort ends."""
        for lane in getattr(self, "lanes", ()):  # the failures not summarised yet
            lane.failures.flush()
        agent = self.generate_fn if isinstance(self.generate_fn, AgentRunner) else None
        if agent is not None:
            agent.abort_episodes()
        if self.engine_service is not None:
            self.engine_service.stop_serving()
        if self.engine is not None:
            await self.engine.abort(None)
        if self.router is not None:
            await self.router.abort(None, wait_s=STOP_WAIT_S)
        if self.engine_service is not None:
            await self.engine_service.drain(timeout=STOP_WAIT_S)  # the answers to the aborted calls go out
        if agent is not None:
            await agent.stop()
        if self.engine is not None:
            record_kv_cache(self.context.run_dir, self.actor_id, self.engine, self.engine.version,
                            self.settings.clock_origin)
            await self.engine.close()
        if self.engine_service is not None:
            self.engine_service.close()
        if self.router is not None:
            self.router.close()
        if self.weights is not None:
            self.weights.close()
