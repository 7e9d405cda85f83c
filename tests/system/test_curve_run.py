"""CURVE end to end: a real run with `--curve-keys`, and strangers knocking at every endpoint it binds.

While the run trains, a client with no key and a client with its own key pair (it knows the cluster's public key,
which is no secret, but not the cluster's secret) try to deliver real messages to every endpoint the run bound, as
soon as it is bound: a stop order and the registration of a made-up actor to the controller, a lease request to the
buffer, a weight-update order to each rollout worker, a stream hello and a group to each inbox, a subscription to
the controller's broadcasts. Any of them delivered would show: the run would stop early, the made-up actor would be
in the logs, the stranger would get a reply, a credit or a broadcast. A client holding the cluster key asks the
same endpoints something harmless at the same time and must be answered, so silence from the others is CURVE's
doing and not a probe aimed at the wrong place.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import subprocess
import threading
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from bus import RpcClient, Subscriber
from bus.codec import decode, encode
from bus.schema import (
    Control,
    EngineGenerate,
    Error,
    GeneratedGroup,
    LeaseRequest,
    Message,
    Register,
    RunState,
    ScoredGroup,
    StreamCredit,
    StreamHello,
    WeightUpdateOrder,
)
from bus.security import CurveKeys, Security, generate_cluster_keys
from tests.system.test_fault_tolerance import launch, trained_steps
from tools.make_arithmetic_data import make_arithmetic_data

NUM_ROLLOUT = 30
RUN_TIMEOUT_S = 150.0
RPC_KINDS = ("rpc", "engine")
INTRUDER = "intruder"  # in every id and reason the strangers send: delivered, it would show up in a log


@dataclass
class Endpoint:
    actor: str  # the actor that bound it
    role: str
    kind: str  # "rpc", "engine" (request/reply too), "inbox" or "publish" (the controller's head address is its "rpc")
    address: str


@dataclass
class Probes:
    """What the strangers and the trusted client got back, endpoint by endpoint."""

    intruder_attempts: list[tuple[Endpoint, str, asyncio.Task[Any]]] = field(default_factory=list)
    trusted_answers: dict[str, asyncio.Task[Any]] = field(default_factory=dict)  # address -> what came back
    closers: list[Any] = field(default_factory=list)


def bound_endpoints(run_dir: Path) -> list[Endpoint]:
    """Every endpoint the run has bound so far, from the actors' own log records."""
    found = []
    for path in sorted((run_dir / "logs").glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if '"controller listening"' not in line and '"actor started"' not in line:
                continue
            with contextlib.suppress(json.JSONDecodeError):  # a line still being written
                record = json.loads(line)
                if record["event"] == "controller listening":
                    found.append(Endpoint(record["actor_id"], "controller", "rpc", record["head"]))
                    found.append(Endpoint(record["actor_id"], "controller", "publish", record["publish"]))
                elif record["event"] == "actor started":
                    found += [Endpoint(record["actor_id"], record["role"], kind, address)
                              for kind, address in record["endpoints"].items()]
    return found


def intruder_requests(endpoint: Endpoint, who: str) -> list[Message]:
    """Requests that would change the run if the endpoint's owner handled them."""
    name = f"{INTRUDER}-{who}"
    if endpoint.role == "controller":
        return [Control(command="stop", reason=f"{name} says stop"),
                Register(actor_id=name, role="rollout", node="nowhere", pid=1,
                         endpoints={"inbox": "tcp://127.0.0.1:9"})]
    if endpoint.role == "buffer":
        return [LeaseRequest(worker_id=name, max_groups=4)]
    if endpoint.kind == "engine":  # a rollout worker's engine, served to the other workers
        return [EngineGenerate(request_id=f"{name}/0", input_ids=[1, 2, 3], max_new_tokens=4)]
    if endpoint.role == "rollout":
        return [WeightUpdateOrder(version=10_000, group={"host": "127.0.0.1", "port": 9, "generation": 1,
                                                         "members": [name], "backend": "gloo"}, timeout_s=1.0)]
    return [Control(command="stop", reason=f"{name} says stop")]


def intruder_data(endpoint: Endpoint, who: str) -> Message:
    name = f"{INTRUDER}-{who}"
    if endpoint.role == "buffer":
        return ScoredGroup(lease_id=name, group_id=name, samples=[], worker_id=name)
    if endpoint.role == "reward":
        return GeneratedGroup(lease_id=name, group_id=name, samples=[], worker_id=name)
    return Control(command="stop", reason=f"{name} says stop")


def dealer(ctx: zmq.asyncio.Context, address: str, security: Security | None, name: str) -> zmq.asyncio.Socket:
    """A plain DEALER (what any zmq program can open) that queues what it sends until a handshake completes."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, f"{name}#{secrets.token_hex(8)}".encode())
    if security is not None:
        security.apply_client(sock)
    sock.connect(address)
    return sock


async def first_frame(sock: zmq.asyncio.Socket) -> Any:
    return decode((await sock.recv_multipart())[-1])


def start_probes(ctx: zmq.asyncio.Context, endpoint: Endpoint, strangers: dict[str, Security | None],
                 trusted: Security, probes: Probes) -> None:
    """The strangers' attempts on `endpoint` (each left waiting for an answer until the run ends) and the trusted
    client's harmless question."""

    def track(task: Awaitable[Any], who: str) -> None:
        probes.intruder_attempts.append((endpoint, who, asyncio.ensure_future(task)))

    for who, security in strangers.items():
        if endpoint.kind in RPC_KINDS:
            for request in intruder_requests(endpoint, who):
                client = RpcClient(ctx, endpoint.address, client_id=f"{INTRUDER}-{who}", security=security)
                probes.closers.append(client)
                track(client.call(request, timeout=RUN_TIMEOUT_S, retries=0), who)
        elif endpoint.kind == "inbox":
            sock = dealer(ctx, endpoint.address, security, f"{INTRUDER}-{who}")
            probes.closers.append(sock)
            hello = StreamHello(sender_id=f"{INTRUDER}-{who}", session=secrets.token_hex(8))
            sock.send(encode(hello))
            sock.send(encode(intruder_data(endpoint, who)))  # data needs no credit to be delivered: try it too
            track(first_frame(sock), who)
        else:
            subscriber = Subscriber(ctx, endpoint.address, [""], security=security)
            probes.closers.append(subscriber)
            track(subscriber.recv(), who)

    if endpoint.kind in RPC_KINDS:
        client = RpcClient(ctx, endpoint.address, client_id="trusted-probe", security=trusted)
        probes.closers.append(client)
        answer: Awaitable[Any] = client.call(RunState(state="running"), timeout=10.0, retries=1)
    elif endpoint.kind == "inbox":
        sock = dealer(ctx, endpoint.address, trusted, "trusted-probe")
        probes.closers.append(sock)
        sock.send(encode(StreamHello(sender_id="trusted-probe", session=secrets.token_hex(8))))
        answer = first_frame(sock)
    else:
        subscriber = Subscriber(ctx, endpoint.address, [""], security=trusted)
        probes.closers.append(subscriber)
        answer = subscriber.recv()
    probes.trusted_answers[endpoint.address] = asyncio.ensure_future(answer)


@pytest.mark.system
@pytest.mark.timeout(240)
async def test_strangers_without_the_cluster_key_deliver_nothing_to_a_curve_run(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    keys = tmp_path / "keys"
    cluster = generate_cluster_keys(keys)
    stranger = CurveKeys.generate()
    strangers: dict[str, Security | None] = {
        "no-key": None,
        # Knows the cluster's public key (the server key every client needs) and holds a pair of its own.
        "wrong-key": Security(CurveKeys(public=cluster.public, secret=stranger.secret), client=stranger),
    }
    trusted = Security(cluster)
    data = make_arithmetic_data(tmp_path / "data", max_operand=9, eval_size=10)["train"]
    run_dir = tmp_path / "run"
    process = launch(run_dir, tiny_model_path, data, NUM_ROLLOUT,
                     extra=("--curve-keys", str(keys), "--save-interval", "10"))
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(process.stdout or ()), daemon=True)
    reader.start()

    ctx = zmq.asyncio.Context()
    probes = Probes()
    probed: dict[str, Endpoint] = {}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + RUN_TIMEOUT_S
    try:
        while process.poll() is None and loop.time() < deadline:
            for endpoint in bound_endpoints(run_dir):
                if endpoint.address not in probed:
                    probed[endpoint.address] = endpoint
                    start_probes(ctx, endpoint, strangers, trusted, probes)
            await asyncio.sleep(0.05)
        running_when_done = process.poll() is None
        await asyncio.sleep(0.5)  # a reply to anything a stranger got through would have landed by now
        outcomes = [(endpoint, who, task.done() and not task.cancelled() and task.exception() is None)
                    for endpoint, who, task in probes.intruder_attempts]
        answers = {address: task.result() if task.done() and task.exception() is None else None
                   for address, task in probes.trusted_answers.items()}
    finally:
        for _, _, task in probes.intruder_attempts:
            task.cancel()
        for task in probes.trusted_answers.values():
            task.cancel()
        for closable in probes.closers:
            if isinstance(closable, zmq.Socket):
                closable.close(linger=0)
            else:
                closable.close()
        ctx.destroy(linger=0)
        if process.poll() is None:  # an orderly stop of every actor first; then no more waiting
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        process.wait(timeout=30)
        reader.join(timeout=10)
    text = "".join(output)
    assert not running_when_done, f"the run did not finish within {RUN_TIMEOUT_S}s:\n{text[-4000:]}"

    # Not one stranger got a reply, a credit or a broadcast back...
    delivered = [f"{who} -> {e.actor} {e.kind} {e.address}" for e, who, got_answer in outcomes if got_answer]
    assert delivered == [], f"strangers got through: {delivered}"
    assert {who for _, who, _ in outcomes} == set(strangers) and len(outcomes) >= 2 * len(probed)
    # ...nothing they said reached a log, and the one with a key pair was refused by the authenticator.
    logs = "".join(path.read_text(encoding="utf-8") for path in (run_dir / "logs").glob("*.jsonl"))
    assert INTRUDER not in logs and INTRUDER not in text, "a stranger's message was handled"
    assert "CURVE: refused a handshake from client key " + stranger.public.decode() in text
    # The run was not disturbed: it trained every step and ended on its own.
    assert process.returncode == 0, text[-4000:]
    assert trained_steps(run_dir) == NUM_ROLLOUT, text[-4000:]
    # Every endpoint of every actor was probed, and each answered the client that holds the key: the strangers'
    # silence is CURVE's doing, not probes aimed at the wrong place or too late.
    actors_with_endpoints = {e.actor for e in bound_endpoints(run_dir)}
    assert {"controller", "buffer", "reward-0-0", "rollout-0-0", "rollout-0-1"} <= actors_with_endpoints
    assert {e.kind for e in probed.values()} == {"rpc", "engine", "inbox", "publish"}
    assert set(probed) == {e.address for e in bound_endpoints(run_dir)}
    unanswered = [f"{e.actor} {e.kind} {e.address}" for e in probed.values() if answers[e.address] is None]
    assert unanswered == [], f"the probe holding the cluster key got no answer from: {unanswered}"
    for endpoint in probed.values():
        answer = answers[endpoint.address]
        if endpoint.kind == "inbox":
            assert isinstance(answer, StreamCredit), answer
        elif endpoint.kind in RPC_KINDS:  # an engine's socket answers a RunState "unhandled" too
            assert isinstance(answer, RunState if endpoint.role == "controller" else Error), answer
