"""The fault-injecting transport (bus/faults.py): its plan, and what real channels do under it."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from bus import faults
from bus.broadcast import Publisher, Subscriber
from bus.faults import FaultPlan, FaultPlanError, FaultySocket
from bus.rpc import RpcClient, RpcServer, RpcTimeout
from bus.schema import Ack, Heartbeat, Message, VersionAnnouncement
from bus.sockets import make_socket
from bus.stream import StreamReceiver, StreamSender
from tests.support.waiting import until


@pytest.fixture
def plan(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """Call with a plan string: sockets made afterwards in this process inject it; undone after the test."""

    def install(text: str, report_dir: Path | None = None) -> None:
        monkeypatch.setenv(faults.PLAN_ENV, text)
        if report_dir is not None:
            monkeypatch.setenv(faults.REPORT_ENV, str(report_dir))
        faults.reload()

    yield install
    monkeypatch.delenv(faults.PLAN_ENV, raising=False)
    faults.reload()


# ----------------------------------------------------------------------------------------------- the plan
@pytest.mark.unit
def test_a_plan_reads_every_item() -> None:
    parsed = FaultPlan.parse("drop=0.02, duplicate=0.03,delay=0.05,delay_ms=20-200,seed=7")
    assert parsed == FaultPlan(drop=0.02, duplicate=0.03, delay=0.05, delay_ms=(20.0, 200.0), seed=7)
    assert FaultPlan.parse("delay=1,delay_ms=50").delay_ms == (50.0, 50.0)
    assert FaultPlan.parse(parsed.describe()) == parsed


@pytest.mark.unit
@pytest.mark.parametrize(("text", "named"), [
    ("drop=0.1,dorp=0.2", "'dorp=0.2'"),
    ("drop=1.5", "'drop=1.5'"),
    ("drop=lots", "'drop=lots'"),
    ("delay_ms=200-20", "'delay_ms=200-20'"),
    ("drop", "'drop'"),
    ("drop=0.1,drop=0.2", "drop given twice"),
    ("drop=0.6,duplicate=0.6", "> 1"),
    (" , ", "holds no item"),
])
def test_a_bad_plan_is_refused_naming_the_item(text: str, named: str) -> None:
    with pytest.raises(FaultPlanError, match=named.replace("(", r"\(")) as caught:
        FaultPlan.parse(text)
    assert faults.PLAN_ENV in str(caught.value)


@pytest.mark.unit
def test_decisions_follow_the_probabilities() -> None:
    injector = faults.FaultInjector(FaultPlan(drop=0.1, duplicate=0.2, delay=0.3, delay_ms=(5, 9)), salt="t")
    fates = [injector.decide("DEALER") for _ in range(20_000)]
    share = {fate: sum(f is fate for f, _ in fates) / len(fates) for fate in faults.Fate}
    assert share[faults.Fate.DROP] == pytest.approx(0.1, abs=0.015)
    assert share[faults.Fate.DUPLICATE] == pytest.approx(0.2, abs=0.015)
    assert share[faults.Fate.DELAY] == pytest.approx(0.3, abs=0.015)
    assert all(0.005 <= delay <= 0.009 for fate, delay in fates if fate is faults.Fate.DELAY)
    assert injector.counts["dropped.DEALER"] == injector.counts["dropped"] > 0
    assert injector.counts["messages"] == 20_000


@pytest.mark.integration
def test_without_a_plan_sockets_are_plain(zctx: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(faults.PLAN_ENV, raising=False)
    faults.reload()
    sock = make_socket(zctx, zmq.DEALER, security=None, server=False)
    assert type(sock) is zmq.asyncio.Socket
    assert type(faults.sync_view(sock)) is zmq.Socket
    assert faults.counts() == {}
    sock.close(linger=0)


# ------------------------------------------------------------------------------------------ real channels
async def _echo(sender: str, request: Message) -> Message:
    return Ack(ok=True, error=None)


@pytest.mark.integration
async def test_every_dropped_request_is_a_timeout(zctx: zmq.asyncio.Context, plan) -> None:
    plan("drop=1")
    server = RpcServer(zctx, "tcp://127.0.0.1:0")
    assert isinstance(server._sock, FaultySocket)
    serving = asyncio.create_task(server.serve(_echo))
    client = RpcClient(zctx, server.endpoint, client_id="c")
    with pytest.raises(RpcTimeout):
        await client.call(Heartbeat(actor_id="c", seq=1), timeout=0.2, retries=1)
    assert server.handled == 0
    assert faults.counts()["dropped.DEALER"] == 2  # the call and its retry
    client.close()
    server.close()
    await asyncio.gather(serving, return_exceptions=True)


@pytest.mark.integration
async def test_duplicated_requests_run_the_handler_once_and_duplicated_replies_arrive_late(
    zctx: zmq.asyncio.Context, plan
) -> None:
    plan("duplicate=1")
    calls = 0

    async def count(sender: str, request: Message) -> Message:
        nonlocal calls
        calls += 1
        return Ack(ok=True, error=None)

    server = RpcServer(zctx, "tcp://127.0.0.1:0")
    serving = asyncio.create_task(server.serve(count))
    client = RpcClient(zctx, server.endpoint, client_id="c")
    for seq in range(5):
        assert isinstance(await client.call(Heartbeat(actor_id="c", seq=seq), timeout=2.0, retries=0), Ack)
    # each reply twice, and the server answers each duplicate from its cache
    await until(lambda: server.duplicates == 5 and client.late_replies >= 5, "the five duplicates and their replies")
    assert calls == 5
    assert faults.counts()["duplicated"] >= 10
    client.close()
    server.close()
    await asyncio.gather(serving, return_exceptions=True)


@pytest.mark.integration
async def test_delayed_messages_arrive_late(zctx: zmq.asyncio.Context, plan) -> None:
    plan("delay=1,delay_ms=80")
    server = RpcServer(zctx, "tcp://127.0.0.1:0")
    serving = asyncio.create_task(server.serve(_echo))
    client = RpcClient(zctx, server.endpoint, client_id="c")
    await client.call(Heartbeat(actor_id="c", seq=0), timeout=2.0, retries=0)  # the connection is up
    started = time.monotonic()
    reply = await client.call(Heartbeat(actor_id="c", seq=1), timeout=2.0, retries=0)
    assert isinstance(reply, Ack)
    assert time.monotonic() - started >= 0.15  # the request and the reply were each held 80 ms
    assert faults.counts()["delayed"] >= 4
    client.close()
    server.close()
    await asyncio.gather(serving, return_exceptions=True)


@pytest.mark.integration
async def test_a_stream_under_duplicates_and_delays_delivers_everything_reordered(
    zctx: zmq.asyncio.Context, plan
) -> None:
    """Hello, credit and data frames are all duplicated or delayed: every message still arrives, some twice and
    out of order, and the window never deadlocks the sender."""
    plan("duplicate=0.3,delay=0.3,delay_ms=1-30")
    receiver = StreamReceiver(zctx, "tcp://127.0.0.1:0", window=4)
    sender = StreamSender(zctx, sender_id="producer", hello_interval=0.05)
    sender.connect("consumer", receiver.endpoint)

    async def produce() -> None:
        for seq in range(100):
            await sender.send(Heartbeat(actor_id="producer", seq=seq), timeout=10)

    producing = asyncio.create_task(produce())
    seen: list[int] = []
    while not (producing.done() and set(seen) >= set(range(100))):
        try:
            _, message = await asyncio.wait_for(receiver.recv(), 5)
        except asyncio.TimeoutError:
            break
        seen.append(message.seq)
    await producing
    assert set(seen) == set(range(100))
    assert len(seen) > 100, "nothing was duplicated"
    assert seen != sorted(seen), "nothing was reordered"
    sender.close()
    receiver.close()


@pytest.mark.integration
async def test_lost_hellos_and_credits_only_cost_time(zctx: zmq.asyncio.Context, plan) -> None:
    """A third of all frames vanish: the sender re-sends its hello while starved and every send completes; the
    messages that arrive are the ones whose data frame was not dropped."""
    plan("drop=0.3")
    receiver = StreamReceiver(zctx, "tcp://127.0.0.1:0", window=64)
    sender = StreamSender(zctx, sender_id="producer", hello_interval=0.05, max_hello_interval=0.2)
    sender.connect("consumer", receiver.endpoint)

    sent = asyncio.Event()

    async def consume() -> list[int]:
        """Until the last send returned and the line went quiet. Stopping at the first quiet second instead (a guess
        at the machine's speed) left a loaded CI run's sender without credit: a receiver that no longer receives
        grants none, and the next send timed out."""
        got = []
        while True:
            try:
                _, message = await asyncio.wait_for(receiver.recv(), 0.2)
            except asyncio.TimeoutError:
                if sent.is_set():
                    return got
                continue
            got.append(message.seq)

    consuming = asyncio.create_task(consume())
    for seq in range(20):
        await sender.send(Heartbeat(actor_id="producer", seq=seq), timeout=10)
    sent.set()
    got = await consuming
    assert got and set(got) <= set(range(20))
    assert faults.counts()["dropped"] > 0
    sender.close()
    receiver.close()


@pytest.mark.integration
async def test_a_dropped_broadcast_is_repaired_by_the_next_state(zctx: zmq.asyncio.Context, plan,
                                                                 tmp_path: Path) -> None:
    plan("drop=0.5,seed=3", report_dir=tmp_path)
    publisher = Publisher(zctx, "tcp://127.0.0.1:0")
    subscriber = Subscriber(zctx, publisher.endpoint, ["version"])
    latest = None
    for version in range(1, 200):
        publisher.publish("version", VersionAnnouncement(version=version, step=version, timestamp=0.0))
        await asyncio.sleep(0.002)
    # Generous: the loop ends at 199. A loaded machine (CI beside other work) took over 5 s to drain the backlog.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (latest is None or latest < 199):
        try:
            _, message = await asyncio.wait_for(subscriber.recv(), 0.5)
        except asyncio.TimeoutError:
            publisher.publish("version", VersionAnnouncement(version=199, step=199, timestamp=0.0))
            continue
        latest = message.version
    assert latest == 199
    await asyncio.sleep(faults.REPORT_EVERY_S + 0.2)
    report = json.loads(next(tmp_path.glob("faults-*.json")).read_text())
    assert report["counts"]["dropped.XPUB"] > 0
    assert report["plan"].startswith("drop=0.5,")
    subscriber.close()
    publisher.close()
