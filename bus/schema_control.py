"""The control plane's messages: membership (register, heartbeat, roster), run lifecycle and the hang check.

Part of the wire schema; `bus.schema` re-exports every name here, and the rules of its docstring apply (maps with
"type" and "v", unknown keys ignored, defaults for missing keys, validation on decode).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from bus.schema_base import Message, Record, doc


class Member(Record):
    """One live-or-dead actor in the roster."""

    actor_id: Annotated[str, doc("unique actor id")]
    role: Annotated[str, doc("controller, buffer, evaluator, learner, rollout, reward or a custom role")]
    node: Annotated[str, doc("host name the actor runs on")]
    pid: Annotated[int, doc("process id on that node")]
    endpoints: Annotated[dict[str, str], doc("channel name -> zmq endpoint others connect to")]
    alive: Annotated[bool, doc("heartbeats arriving within the deadline")] = True
    incarnation: Annotated[int, doc("how many times this actor id registered (restarts)")] = 0
    policy: Annotated[str | None, doc("the policy this actor belongs to (its buffer, learner, evaluator) in a run "
                                      "of several; null for the shared actors and in a run of one")] = None


RosterEventKind = Literal["joined", "died", "returned", "left"]


class RosterEvent(Record):
    """A change in the roster since the previous generation."""

    kind: Annotated[RosterEventKind, doc("what happened")]
    actor_id: Annotated[str, doc("who it happened to")]
    reason: Annotated[str, doc("e.g. heartbeat deadline missed")] = ""


class Roster(Message):
    """Controller -> everyone (broadcast, topic "roster"; also inside Registered): who is in the run."""

    generation: Annotated[int, doc("increments on every change; receivers ignore older generations")]
    members: Annotated[list[Member], doc("every known actor, dead ones included")]
    events: Annotated[list[RosterEvent], doc("changes since the previous generation")] = msgspec.field(
        default_factory=list
    )
    policies: Annotated[dict[str, dict[str, Any]], doc(
        "a run of several policies: the policies in it now (declared at start or joined since, less those that "
        "left), each with the settings it sets for itself; empty in a run of one")] = msgspec.field(
        default_factory=dict
    )


class Register(Message):
    """Actor -> controller (RPC), first message of every actor; reply Registered."""

    actor_id: Annotated[str, doc("unique actor id")]
    role: Annotated[str, doc("the actor's role")]
    node: Annotated[str, doc("host name")]
    pid: Annotated[int, doc("process id")]
    endpoints: Annotated[dict[str, str], doc("channel name -> endpoint the actor bound")]
    meta: Annotated[dict[str, Any], doc("role-specific facts (engine kind, capacity, device); a rollout worker's "
                                        "`adapter_room` (int) and `adapter_room_why`: how many policies' adapters its "
                                        "engine holds, which the controller checks a joining policy against")] = (
        msgspec.field(default_factory=dict)
    )
    policy: Annotated[str | None, doc("the policy the actor belongs to (Member.policy)")] = None


class Leave(Message):
    """Actor -> controller (RPC) when it stops on purpose, so peers hear "left" at once, not after a deadline."""

    actor_id: Annotated[str, doc("the leaving actor")]
    reason: Annotated[str, doc("why it stops")] = ""


class PolicyJoin(Message):
    """Launcher -> controller (RPC): a policy joins the running job with these settings of its own, before its
    buffer, learner and evaluator start; reply Ack (ok=False: refused, the error says why)."""

    policy: Annotated[str, doc("the policy's name (lower-case letters, digits, _)")]
    settings: Annotated[dict[str, Any], doc("the settings the policy sets for itself, as under `policies:` in the "
                                            "run's YAML")] = msgspec.field(default_factory=dict)


class PolicyLeave(Message):
    """Launcher or operator -> controller (RPC): a policy leaves the running job; its buffer, learner and evaluator
    stop (its learner checkpoints), the shared workers stop generating for it; reply Ack."""

    policy: Annotated[str, doc("the leaving policy")]
    reason: Annotated[str, doc("why it leaves")] = ""


class Registered(Message):
    """Controller -> actor (RPC reply to Register): the current roster and how to stay alive."""

    roster: Annotated[Roster, doc("roster including the new member")]
    publish_endpoint: Annotated[str, doc("controller's broadcast endpoint to subscribe to")]
    heartbeat_interval: Annotated[float, doc("seconds between Heartbeats")]
    deadline: Annotated[float, doc("seconds without a heartbeat before the actor is declared dead")]
    incarnation: Annotated[int, doc("the actor's incarnation number")] = 0
    controller: Annotated[str, doc("random id of this controller process: a new one counts roster "
                                   "generations from 0 again")] = ""


class RunConfigQuery(Message):
    """Launcher of a worker node -> controller (RPC): the run's settings, so that a node joins a run with the head's
    address alone; reply RunConfigReply."""

    node_rank: Annotated[int, doc("the asking node's rank")] = 0


class RunConfigReply(Message):
    """Controller -> launcher (RPC reply to RunConfigQuery): the settings every actor of the run was given."""

    settings: Annotated[dict[str, Any], doc("the run's configuration by section, as RUN_DIR/config.yaml holds it")]


class WaitState(Record):
    """Something an actor is waiting for right now: what the controller's hang report is made of."""

    on: Annotated[str, doc("whom or what it waits for: an actor id, a role, or a local resource (engine, reward "
                           "function)")]
    what: Annotated[str, doc("what it waits for, in words (\"batch 41\", \"a lease: admission closed\")")]
    waited_s: Annotated[float, doc("seconds it has waited so far, measured by the waiting actor")] = 0.0


class Heartbeat(Message):
    """Actor -> controller (RPC) every heartbeat_interval; reply Ack (ok=False: register again)."""

    actor_id: Annotated[str, doc("sender")]
    seq: Annotated[int, doc("increments per heartbeat of this incarnation")]
    counters: Annotated[dict[str, float], doc("metrics snapshot (queue depths, samples/s, drops by reason)")] = (
        msgspec.field(default_factory=dict)
    )
    progress: Annotated[int, doc("units of work this process finished (groups generated or scored or accepted, "
                                 "batches served, steps trained); the run is hung when no actor's moves for "
                                 "--hang-timeout")] = 0
    waits: Annotated[list[WaitState], doc("what the actor is waiting for now, oldest first")] = msgspec.field(
        default_factory=list
    )


class StateReport(Message):
    """Actor -> controller (RPC) when a Control "report" asks: its waits and every stack, for the hang report."""

    actor_id: Annotated[str, doc("sender")]
    waits: Annotated[list[WaitState], doc("what the actor is waiting for now, oldest first")] = msgspec.field(
        default_factory=list
    )
    stacks: Annotated[str, doc("every thread's and asyncio task's Python stack, as text (bounded in size)")] = ""


class Control(Message):
    """Controller -> everyone (broadcast, topic "control"): change what actors are doing.

    "abort" ends the run as failed (every actor stops and exits with the run-failed code, so every node's launcher
    fails with `reason`); "report" asks every actor for a StateReport (the hang detector's evidence). In a run of
    several policies a policy's learner that finished sends the controller a "stop" naming its policy: the
    controller broadcasts a stop only once every policy has finished."""

    command: Annotated[Literal["pause", "resume", "drain", "stop", "abort", "report"], doc("the order")]
    reason: Annotated[str, doc("human-readable why")] = ""
    policy: Annotated[str | None, doc("with a stop sent to the controller: this policy finished training and the "
                                      "others go on (a run of several); null: the whole run")] = None


class RunState(Message):
    """Controller -> everyone (broadcast, topic "run_state"): the lifecycle state of the run."""

    state: Annotated[Literal["starting", "running", "draining", "stopped", "failed"], doc("current state")]
    version: Annotated[int, doc("policy version at the time of the change")] = 0
    reason: Annotated[str, doc("why the state changed")] = ""
    timestamp: Annotated[float, doc("unix time of the change (controller clock)")] = 0.0
