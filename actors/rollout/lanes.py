"""A rollout worker's lanes: one per policy it generates for, sharing its engine.

In a run of several policies every engine serves each policy's LoRA adapter under the policy's name, and a worker
generates for all of them. What is a policy's own lives in its lane: the buffer it leases from, what it heard of its
learner's versions, whether its weights landed, its staleness bound, the leases it holds and the groups it handed to
the reward workers, its generation failures in a row (`failures.py`), and the engine as the policy sees it
(`AdapterEngine`: every request names the policy's adapter, and the version is the adapter's). What the lanes share
is the worker's: the engine's rows, the router, the reward stream. A run of one unnamed policy has one lane, of policy
None, whose engine is the worker's engine itself. So does a rollout worker of a policy with engines of its own
(`own_engines`), but its lane is the policy's: it leases from the policy's buffer and sends the policy's groups.

Policies join and leave a running job (`actors.controller.policy_table`): the roster says which are in it, and a
shared worker opens a lane for one that joined and shares the run's engines (its adapter served fresh on the engine
until its learner's first push; one with engines of its own brings its own workers, `own_engines`) and
closes the lane of one that left (no more leases; what it was generating goes to the reward workers, who drop it,
and its buffer gives those groups out again if the policy comes back; its adapter leaves the engine once idle).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from actors.config import RunConfig
from actors.config.policies import ADAPTER_ROOM, ADAPTER_ROOM_WHY, sharing_engines
from actors.config.run import policy_run_config
from actors.rollout.cross_policy import Crossing
from actors.rollout.failures import GenerateFailures
from actors.rollout.handed_off import HandedOff
from engines.inference.base import GenerateOutput, GenerateRequest, InferenceEngine, PauseMode
from policies.weight_versions import LearnerVersions

if TYPE_CHECKING:
    import torch


class AdapterEngine(InferenceEngine):
    """An engine as one policy sees it: its requests name the policy's adapter (unless one names its own), its
    version is the adapter's, and a weight update loads into the adapter. So every generate path, a plugin's or an
    agent episode's included, samples from the policy's weights without knowing there are others. Everything else
    (pause, abort, health, an SGLang engine's `url`) is the engine's: closing a view closes nothing."""

    def __init__(self, engine: InferenceEngine, adapter: str) -> None:
        self.engine, self.adapter = engine, adapter

    async def generate(self, request: GenerateRequest) -> list[GenerateOutput]:
        if request.adapter is None:
            request = dataclasses.replace(request, adapter=self.adapter)
        return await self.engine.generate(request)

    async def abort(self, request_id: str | None = None) -> None:
        await self.engine.abort(request_id)

    async def pause(self, mode: PauseMode = "keep") -> None:
        await self.engine.pause(mode)

    async def resume(self) -> None:
        await self.engine.resume()

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        await self.engine.update_weights(named_tensors, version, adapter=self.adapter)  # type: ignore[call-arg]

    @property
    def version(self) -> int:
        return self.engine.adapter_version(self.adapter)  # type: ignore[attr-defined]

    async def health(self) -> dict[str, object]:
        return await self.engine.health()

    async def close(self) -> None:
        """Nothing to close: the worker closes its engine."""

    def __getattr__(self, name: str) -> Any:
        if name == "engine":  # looked up before __init__ set it (copy, pickle)
            raise AttributeError(name)
        return getattr(self.engine, name)


@dataclass(eq=False)
class Lane:
    """One policy's share of a rollout worker (see the module docstring). `engine` is the worker's engine as the
    policy sees it; `config` the policy's settings (the run's own for policy None)."""

    policy: str | None
    config: RunConfig
    buffer: Any  # the policy's buffer (a PeerRpc)
    engine: InferenceEngine
    log: Any  # the worker's, bound to the policy in a run of several
    own_engine: bool = False  # the policy's own engine (own_engines): its weights are the engine's, not an adapter
    versions: LearnerVersions = field(default_factory=LearnerVersions)
    weights_landed: asyncio.Event = field(default_factory=asyncio.Event)
    # Set by what usually opens admission (a version announcement) or lets old weights train again (a push): a lane
    # told "nothing now" asks again at once instead of at its next poll.
    work_may_open: asyncio.Event = field(default_factory=asyncio.Event)
    held_leases: dict[str, int] = field(default_factory=dict)  # lease id -> groups still generating
    leased_before: bool = False  # its buffer answered a lease request: the first says we hold none of its leases
    handed_off: HandedOff = field(init=False)  # the groups handed to each reward worker, for LostGroups
    failures: GenerateFailures = field(init=False)  # by the policy's --generate-failure-limit
    crossing: Crossing = field(init=False)  # whom its episodes feed, its room for adopted groups, its hold-back

    def __post_init__(self) -> None:
        self.handed_off = HandedOff(keep_s=self.config.buffer.lease_timeout)
        self.failures = GenerateFailures(self.log, self.config)
        self.crossing = Crossing(self.log)

    @property
    def max_staleness(self) -> int:
        return self.config.buffer.max_staleness

    def weights_too_old(self) -> bool:
        """The policy's weights on the engine are older than anything its buffer would accept."""
        return self.versions.too_old(self.engine.version, self.max_staleness)

    def oldest_accepted(self) -> int:
        return self.versions.oldest_accepted(self.max_staleness)

    @property
    def adapter(self) -> str | None:
        """The adapter the policy's weights are on the engine (what a weight update names); None: the engine's own."""
        return None if self.own_engine else self.policy

    def view(self, engine: InferenceEngine) -> InferenceEngine:
        """`engine` (the worker's own, or the router's view of the run's engines) as this policy sees it."""
        return engine if self.adapter is None else AdapterEngine(engine, self.adapter)


def worker_lanes(config: RunConfig, own_policy: str | None, buffer_of: Callable[[str | None], Any],
                 engine: InferenceEngine, log: Any) -> list[Lane]:
    """The lanes a worker opens at its start, each leasing from `buffer_of(policy)`: one per policy on the run's
    engines (one of policy None in a run of one), or on a policy's own engine (`own_policy`) that policy's alone."""
    if own_policy is not None:
        return [Lane(own_policy, config, buffer_of(own_policy), engine, log.bind(policy=own_policy), own_engine=True)]
    return [policy_lane(config, policy, buffer_of(policy), engine, log)
            for policy in sharing_engines(config.policies) or (None,)]


def policy_lane(config: RunConfig, policy: str | None, buffer: Any, engine: InferenceEngine, log: Any,
                overrides: dict[str, Any] | None = None) -> Lane:
    """`policy`'s lane on the worker's `engine` (None: the run's one unnamed policy); `overrides`: the settings of a
    policy that joined the running job."""
    if policy is None:
        return Lane(None, config, buffer, engine, log)
    lane = Lane(policy, policy_run_config(config, policy, overrides), buffer, engine, log.bind(policy=policy))
    lane.engine = lane.view(engine)
    return lane


async def follow_policies(worker: Any, policies: dict[str, dict]) -> None:
    """The roster's `policies`, followed by a rollout `worker` of the run's shared engines: a lane for each that
    joined and shares them, its adapter served fresh until its learner pushes; none for one that left, its adapter
    retired once idle. A policy with engines of its own (`own_engines`), declared or joined, has no lane here: its
    own workers generate for it, each with the one lane it started with. The last lane stays: with no policy left
    the run ends."""
    if not policies or worker.engine is None or worker.context.policy is not None:
        return
    policies, engine = sharing_engines(policies), worker.engine
    for lane in [lane for lane in worker.lanes if lane.policy not in policies][:len(worker.lanes) - 1]:
        worker.lanes.remove(lane)
        worker.log.info("policy left the run: no more groups for it", policy=lane.policy)
        worker.retiring[str(lane.policy)] = worker.spawn(retire_adapter(
            engine, str(lane.policy), timeout=worker.config.buffer.lease_timeout, log=worker.log))
    for policy in [name for name in policies if worker.lane_of(name) is None]:
        if (retiring := worker.retiring.pop(policy, None)) is not None:
            retiring.cancel()  # back before its adapter left the engine: it stays, and serves it again
        engine.serve_adapter(policy)
        worker.lanes.append(policy_lane(worker.config, policy, worker.peer_rpc("buffer", policy=policy), engine,
                                        worker.log, overrides=policies[policy]))
        worker.log.info("policy joined the run: generating for it", policy=policy)


async def adapter_room(engine: InferenceEngine) -> dict[str, object]:
    """What a worker says of its engine when it registers (`Register.meta`), which the controller checks a joining
    policy against: how many policies' adapters it has room for, and why (an SGLang server's, launched or attached,
    from its `/server_info`). Empty when the engine does not say: the torch engine's room is the run's setting
    (`actors.config.policies`)."""
    room = await engine.policy_room() if hasattr(engine, "policy_room") else None
    return {} if room is None else {ADAPTER_ROOM: room[0], ADAPTER_ROOM_WHY: room[1]}


async def retire_adapter(engine: InferenceEngine, policy: str, *, timeout: float, log: Any) -> None:
    """A policy left: its adapter leaves `engine` once none of its requests is in flight, within `timeout` (its
    slot stays taken otherwise, said in the log; a policy joining again under the name reuses it). Any failure is
    said, not raised: an SGLang server that restarted or lost the adapter must not stop the worker, whose other
    policies generate on."""
    if hasattr(engine, "stop_serving"):  # an SGLang server: it waits for the adapter's requests itself
        stop = engine.stop_serving(policy, timeout=timeout)
    else:
        stop = _unload_when_idle(engine, policy, timeout)
    try:
        await stop
    except Exception as error:  # TimeoutError, ValueError, SglangError (the server's answer); not a cancel
        log.warning("adapter of a policy that left not unloaded", policy=policy, error=str(error)[:300])
    else:
        log.info("adapter of a policy that left unloaded", policy=policy)


async def _unload_when_idle(engine: Any, policy: str, timeout: float) -> None:
    """The torch engine refuses to unload an adapter its requests still use: ask again until they are done."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            await engine.unload_adapter(policy)
            return
        except ValueError:
            if time.monotonic() >= deadline:
                raise
        await asyncio.sleep(0.5)
