"""Failed transfers name the receiver at fault, commit nothing, and leave the sender able to carry on; a death the
learner knows of ends every wait at once; and nothing of the transfer listens beyond the configured address."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch import Tensor

from engines.weights import (
    GroupSpec,
    TorchDistributedWeightReceiver,
    TorchDistributedWeightSender,
    WeightTransferError,
)
from engines.weights.group import connect_store, generation_store
from tests.support.sockets import listening

SHORT_S = 3.0  # how long the sender waits for a peer that will never come while another one gets ready
ABSENT_S = 0.5  # how long it waits for a peer that will never come once every other one is in
LONG_S = 60.0
# The receivers are forked from one server that imported torch and the transfer once, instead of each importing
# them on its own (nothing it imports initialises CUDA). By names importable from the repository root, where the
# tests run: the server does not get pytest's sys.path, under which this module has another name.
PROCESSES = mp.get_context("forkserver")
PROCESSES.set_forkserver_preload(["pytest", "torch", "engines.weights", "engines.weights.group",
                                  "tests.support.sockets"])


def _weights(version: int) -> list[tuple[str, Tensor]]:
    generator = torch.Generator().manual_seed(version)
    return [
        ("embed.weight", torch.randn(32, 16, generator=generator)),
        ("norm.weight", torch.randn(16, generator=generator)),
    ]


def _digests(items: Any) -> dict[str, str]:
    return {
        name: hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        for name, t in items
    }


def _copying_loader(live: dict[str, Tensor]) -> Any:
    def load(items: Any) -> None:
        for name, tensor in items:
            live[name] = tensor.clone()

    return load


def _rejoining_receiver(spec: dict[str, Any], name: str, next_specs: mp.Queue, events: mp.Queue) -> None:
    """Joins a generation that is aborted, then joins the next one it is given and receives once."""
    torch.set_num_threads(1)
    events.put(("joining", ""))
    try:
        TorchDistributedWeightReceiver.join(GroupSpec.from_dict(spec), name, timeout_s=LONG_S)
        events.put(("joined", ""))
    except WeightTransferError as error:
        events.put(("join failed", str(error)))
    receiver = TorchDistributedWeightReceiver.join(
        GroupSpec.from_dict(next_specs.get(timeout=LONG_S)), name, timeout_s=LONG_S
    )
    live: dict[str, Tensor] = {}
    version = receiver.receive(_copying_loader(live), timeout=LONG_S)
    events.put(("received", (version, _digests(live.items()))))


def _group_with_engine_0() -> tuple[TorchDistributedWeightSender, GroupSpec, mp.Queue, mp.Queue, Any]:
    """A sender with generation 0 open for learner, engine-0 and engine-1, and engine-0 running (a
    `_rejoining_receiver`) and about to join; engine-1 is the test's to play."""
    sender = TorchDistributedWeightSender(timeout_s=LONG_S)
    spec = sender.open_group(["learner", "engine-0", "engine-1"])
    next_specs, events = PROCESSES.Queue(), PROCESSES.Queue()
    engine_0 = PROCESSES.Process(
        target=_rejoining_receiver, args=(spec.to_dict(), "engine-0", next_specs, events), daemon=True
    )
    engine_0.start()
    assert events.get(timeout=LONG_S) == ("joining", "")  # started: process start-up is not what is timed
    return sender, spec, next_specs, events, engine_0


@pytest.mark.integration
def test_receiver_that_never_joins_is_named_and_the_sender_regroups() -> None:
    sender, spec, next_specs, events, present = _group_with_engine_0()
    try:
        joined = generation_store(connect_store(spec.host, spec.port, LONG_S), spec.generation)
        joined.wait(["joined/1"], timedelta(seconds=LONG_S))  # engine-0 is in: only engine-1 can be missing
        with pytest.raises(WeightTransferError, match="generation 0 not formed") as failure:
            sender.wait_for_receivers(timeout_s=ABSENT_S)
        assert list(failure.value.failed) == ["engine-1"]
        assert "never joined" in failure.value.failed["engine-1"]
        outcome, message = events.get(timeout=LONG_S)
        assert outcome == "join failed" and "never joined: engine-1" in message

        weights = _weights(7)
        next_specs.put(sender.open_group(["learner", "engine-0"]).to_dict())
        sender.wait_for_receivers()
        report = sender.send(weights, version=7)
        assert report.version == sender.committed_version == 7
        outcome, (version, digests) = events.get(timeout=LONG_S)
        assert outcome == "received" and version == 7 and digests == _digests(weights)
    finally:
        present.join(timeout=LONG_S)
        sender.close()


def _flaky_receiver(spec: dict[str, Any], name: str, events: mp.Queue) -> None:
    """engine-1's first load raises, as an engine out of memory would; its second succeeds."""
    torch.set_num_threads(1)
    receiver = TorchDistributedWeightReceiver.join(GroupSpec.from_dict(spec), name, timeout_s=LONG_S)
    for transfer in range(2):
        live: dict[str, Tensor] = {}
        copy = _copying_loader(live)

        def load(items: Any, copy: Any = copy, transfer: int = transfer) -> None:
            if name == "engine-1" and transfer == 0:
                raise RuntimeError("disk on fire")
            copy(items)

        try:
            version = receiver.receive(load, timeout=LONG_S)
            events.put((name, "ok", version, _digests(live.items())))
        except WeightTransferError as error:
            events.put((name, "error", None, str(error)))


@pytest.mark.integration
def test_failed_load_is_named_not_committed_and_the_group_keeps_working() -> None:
    sender = TorchDistributedWeightSender(timeout_s=LONG_S)
    spec = sender.open_group(["learner", "engine-0", "engine-1"])
    events = PROCESSES.Queue()
    processes = [
        PROCESSES.Process(target=_flaky_receiver, args=(spec.to_dict(), name, events), daemon=True)
        for name in ("engine-0", "engine-1")
    ]
    for process in processes:
        process.start()
    try:
        sender.wait_for_receivers()
        with pytest.raises(WeightTransferError, match="version 1 not committed") as failure:
            sender.send(_weights(1), version=1)
        assert list(failure.value.failed) == ["engine-1"]
        assert "disk on fire" in failure.value.failed["engine-1"]
        assert sender.committed_version is None
        first = {
            name: (outcome, detail) for name, outcome, _, detail in (events.get(timeout=LONG_S) for _ in range(2))
        }
        assert first["engine-0"] == ("ok", _digests(_weights(1)))
        assert first["engine-1"][0] == "error" and "disk on fire" in first["engine-1"][1]

        report = sender.send(_weights(2), version=2)
        assert report.version == sender.committed_version == 2
        second = [events.get(timeout=LONG_S) for _ in range(2)]
        assert all(
            outcome == "ok" and version == 2 and digests == _digests(_weights(2))
            for _, outcome, version, digests in second
        )
    finally:
        for process in processes:
            process.join(timeout=LONG_S)
        sender.close()


def _dying_receiver(spec: dict[str, Any], name: str, events: mp.Queue) -> None:
    torch.set_num_threads(1)
    receiver = TorchDistributedWeightReceiver.join(GroupSpec.from_dict(spec), name, timeout_s=LONG_S)
    receiver.receive(lambda items: None, timeout=LONG_S)
    if name == "engine-1":
        os._exit(0)  # the engine crashes between two updates
    try:
        receiver.receive(lambda items: None, timeout=LONG_S)
        events.put((name, "ok"))
    except WeightTransferError as error:
        events.put((name, str(error)))


@pytest.mark.integration
def test_receiver_that_died_since_the_last_transfer_is_named_before_bytes_move() -> None:
    sender = TorchDistributedWeightSender(timeout_s=LONG_S)
    spec = sender.open_group(["learner", "engine-0", "engine-1"])
    events = PROCESSES.Queue()
    processes = [
        PROCESSES.Process(target=_dying_receiver, args=(spec.to_dict(), name, events), daemon=True)
        for name in ("engine-0", "engine-1")
    ]
    for process in processes:
        process.start()
    try:
        sender.wait_for_receivers()
        sender.send(_weights(1), version=1)
        processes[1].join(timeout=LONG_S)
        started = time.monotonic()
        with pytest.raises(WeightTransferError, match="version 2 not started") as failure:
            sender.send(_weights(2), version=2, timeout_s=SHORT_S)
        assert time.monotonic() - started < SHORT_S + 5
        assert list(failure.value.failed) == ["engine-1"]
        assert sender.committed_version == 1
        name, message = events.get(timeout=LONG_S)
        assert name == "engine-0" and "aborted" in message and "engine-1" in message
        with pytest.raises(WeightTransferError, match="call open_group"):
            sender.send(_weights(3), version=3)
    finally:
        for process in processes:
            process.join(timeout=LONG_S)
        sender.close()


def _aborted_receiver(spec: dict[str, Any], name: str, dies: str, next_specs: mp.Queue, events: mp.Queue) -> None:
    """Receives version 1; then engine-1 dies (`dies`: before version 2 or inside its first bucket) while engine-0
    receives version 2 until the sender gives it up, then joins the next generation it is given and receives."""
    torch.set_num_threads(1)
    receiver = TorchDistributedWeightReceiver.join(GroupSpec.from_dict(spec), name, timeout_s=LONG_S)
    receiver.receive(lambda items: None, timeout=LONG_S)
    if name == "engine-1" and dies == "between transfers":
        os._exit(0)

    def load(items: Any) -> None:
        if name == "engine-1":
            os._exit(0)

    try:
        receiver.receive(load, timeout=LONG_S)
        events.put((name, "received version 2", time.time()))
    except WeightTransferError as error:
        events.put((name, str(error), time.time()))
    receiver = TorchDistributedWeightReceiver.join(
        GroupSpec.from_dict(next_specs.get(timeout=LONG_S)), name, timeout_s=LONG_S
    )
    events.put((name, receiver.receive(lambda items: None, timeout=LONG_S), time.time()))


def _replacement(spec: dict[str, Any], name: str, events: mp.Queue) -> None:
    torch.set_num_threads(1)
    receiver = TorchDistributedWeightReceiver.join(GroupSpec.from_dict(spec), name, timeout_s=LONG_S)
    events.put((name, receiver.receive(lambda items: None, timeout=LONG_S), time.time()))


@pytest.mark.integration
@pytest.mark.timeout(120)
@pytest.mark.parametrize("dies", ["between transfers", "mid-transfer"])
def test_an_abort_frees_the_sender_and_the_survivor_at_once_and_the_next_generation_commits(dies: str) -> None:
    """The learner hears of a death from its roster long before gloo or the transfer timeout notices (gloo waits
    for a dead peer until the group's timeout, mid-broadcast included): `abort` must end the wait on both ends
    within a second, and the replacement under the same name must be served by the next generation."""
    # Small buckets, 32 MB in all: the broadcast to a dead engine-1 blocks well before the last bucket.
    sender = TorchDistributedWeightSender(timeout_s=LONG_S, bucket_bytes=1 << 20, direct_bytes=1 << 30)
    spec = sender.open_group(["learner", "engine-0", "engine-1"])
    next_specs, events = PROCESSES.Queue(), PROCESSES.Queue()
    processes = [
        PROCESSES.Process(target=_aborted_receiver, args=(spec.to_dict(), name, dies, next_specs, events), daemon=True)
        for name in ("engine-0", "engine-1")
    ]
    for process in processes:
        process.start()
    weights = [(f"layer.{index}", torch.randn(1 << 20)) for index in range(8)]
    try:
        sender.wait_for_receivers()
        sender.send(weights, version=1)
        if dies == "between transfers":
            processes[1].join(timeout=LONG_S)
        threading.Timer(1.0, sender.abort, args=({"engine-1": "died (the roster says)"},)).start()
        started = time.time()
        with pytest.raises(WeightTransferError, match="version 2") as failure:
            sender.send(weights, version=2)
        given_up = time.time()
        assert given_up - started < 2.5, f"the sender waited {given_up - started:.1f}s for a dead receiver"
        name, outcome, when = events.get(timeout=LONG_S)
        assert name == "engine-0" and outcome != "received version 2"
        assert when - given_up < 1.5, f"the survivor left {when - given_up:.1f}s after the sender gave up"
        if dies == "between transfers":  # no collective runs: only the abort can end the wait
            assert failure.value.failed == {"engine-1": "died (the roster says)"}
            assert "engine-1: died (the roster says)" in outcome
        else:  # gloo may notice the closed connection first; either way the dead one is named
            assert "engine-1" in failure.value.failed
        assert sender.committed_version == 1

        spec = sender.open_group(["learner", "engine-0", "engine-1"])
        next_specs.put(spec.to_dict())
        replacement = PROCESSES.Process(target=_replacement, args=(spec.to_dict(), "engine-1", events), daemon=True)
        replacement.start()
        processes.append(replacement)
        sender.wait_for_receivers()
        assert sender.send(weights, version=3).version == sender.committed_version == 3
        assert sorted(events.get(timeout=LONG_S)[:2] for _ in range(2)) == [("engine-0", 3), ("engine-1", 3)]
    finally:
        for process in processes:
            process.join(timeout=LONG_S)
        sender.close()


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_member_that_dies_while_the_group_forms_costs_a_second_not_the_timeout() -> None:
    """engine-1 joins and dies before it builds its gloo group: the sender and engine-0 are then inside gloo's
    rendezvous, waiting for an address that will never come. The learner's abort (the roster heard of the death)
    must end both waits within a second, not at the transfer timeout, and the next generation must commit."""
    sender, spec, next_specs, events, survivor = _group_with_engine_0()
    processes = [survivor]
    try:
        # engine-1's join, up to its death: registered under its rank, never at the rendezvous.
        store = connect_store(spec.host, spec.port, LONG_S)
        generation_store(store, spec.generation).set("joined/2", b"engine-1")
        threading.Timer(1.0, sender.abort, args=({"engine-1": "died (the roster says)"},)).start()
        started = time.time()
        with pytest.raises(WeightTransferError, match="not formed") as failure:
            sender.wait_for_receivers()
        given_up = time.time()
        assert given_up - started < 2.5, f"the sender waited {given_up - started:.1f}s for a dead member"
        assert failure.value.failed == {"engine-1": "died (the roster says)"}
        outcome, why = events.get(timeout=LONG_S)
        assert outcome == "join failed" and "engine-1: died (the roster says)" in why, why
        assert time.time() - given_up < 1.5, f"engine-0 left {time.time() - given_up:.1f}s after the sender"

        spec = sender.open_group(["learner", "engine-0", "engine-1"])
        next_specs.put(spec.to_dict())
        replacement = PROCESSES.Process(
            target=_replacement, args=(spec.to_dict(), "engine-1", events), daemon=True
        )
        replacement.start()
        processes.append(replacement)
        sender.wait_for_receivers()
        weights = _weights(3)
        assert sender.send(weights, version=3).version == sender.committed_version == 3
        received = sorted(str(events.get(timeout=LONG_S)[0]) for _ in range(2))
        assert received == ["engine-1", "received"]
    finally:
        for process in processes:
            process.join(timeout=LONG_S)
        sender.close()


def _reporting_receiver(spec: dict[str, Any], name: str, events: mp.Queue) -> None:
    torch.set_num_threads(1)
    receiver = TorchDistributedWeightReceiver.join(GroupSpec.from_dict(spec), name, timeout_s=LONG_S)
    events.put(listening())
    receiver.receive(lambda items: None, timeout=LONG_S)


def _this_machines_other_address() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: only the route is asked for, no packet is sent
        except OSError:
            pytest.skip("no network route off this machine")
        address = probe.getsockname()[0]
    if address.startswith("127."):
        pytest.skip("this machine has no address but loopback")
    return address


@pytest.mark.integration
@pytest.mark.parametrize("where", ["loopback", "another interface"])
def test_the_store_and_gloo_listen_only_on_the_configured_address(where: str) -> None:
    """`--host` keeps the weight transfer off every other interface: torch's store server listens on all of them
    unless handed a socket, and gloo's on whatever the hostname resolves to."""
    host = "127.0.0.1" if where == "loopback" else _this_machines_other_address()
    before = listening()
    sender = TorchDistributedWeightSender(host=host, timeout_s=LONG_S)
    spec = sender.open_group(["learner", "engine-0"])
    events = PROCESSES.Queue()
    receiver = PROCESSES.Process(
        target=_reporting_receiver, args=(spec.to_dict(), "engine-0", events), daemon=True
    )
    receiver.start()
    try:
        sender.wait_for_receivers()
        sender.send(_weights(1), version=1)
        ours = listening() - before
        assert (host, sender.port) in ours
        assert {address for address, _ in ours} == {host}, f"the sender listens on {sorted(ours)}"
        theirs = events.get(timeout=LONG_S)
        assert theirs and {address for address, _ in theirs} == {host}, f"the receiver listens on {sorted(theirs)}"
    finally:
        receiver.join(timeout=LONG_S)
        sender.close()


def _sender_that_is_killed(spec_queue: mp.Queue) -> None:
    """A learner that opens a group for engine-0 and waits there until the test kills it."""
    torch.set_num_threads(1)
    sender = TorchDistributedWeightSender(timeout_s=LONG_S)
    spec_queue.put(sender.open_group(["learner", "engine-0"]).to_dict())
    sender.wait_for_receivers()
    spec_queue.put("joined")
    time.sleep(LONG_S)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_learner_that_died_fails_the_next_receive_as_a_transfer_error() -> None:
    """Seen when the learner was killed with SIGKILL mid-push: the engine's calls to its store raised the store's
    DistNetworkError, which the rollout worker logged as a handler's traceback instead of the one-line 'weight
    update given up' it gives a failed transfer."""
    queue = PROCESSES.Queue()
    learner = PROCESSES.Process(target=_sender_that_is_killed, args=(queue,), daemon=True)
    learner.start()
    try:
        receiver = TorchDistributedWeightReceiver.join(GroupSpec.from_dict(queue.get(timeout=LONG_S)), "engine-0",
                                                       timeout_s=LONG_S)
        assert queue.get(timeout=LONG_S) == "joined"
        learner.kill()
        learner.join(timeout=LONG_S)
        with pytest.raises(WeightTransferError, match="engine-0: the sender's store went away"):
            receiver.receive(lambda items: None, timeout=SHORT_S)
    finally:
        if learner.is_alive():
            learner.kill()
