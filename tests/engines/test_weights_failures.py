"""Failed transfers name the receiver at fault, commit nothing, and leave the sender able to carry on."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import time
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

SHORT_S = 3.0  # how long the sender waits for a peer that will never come
LONG_S = 60.0


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


@pytest.mark.integration
def test_receiver_that_never_joins_is_named_and_the_sender_regroups() -> None:
    context = mp.get_context("spawn")
    sender = TorchDistributedWeightSender(timeout_s=LONG_S)
    spec = sender.open_group(["learner", "engine-0", "engine-1"])
    next_specs, events = context.Queue(), context.Queue()
    present = context.Process(
        target=_rejoining_receiver, args=(spec.to_dict(), "engine-0", next_specs, events), daemon=True
    )
    present.start()
    try:
        assert events.get(timeout=LONG_S) == ("joining", "")  # started: process start-up is not what is timed
        with pytest.raises(WeightTransferError, match="generation 0 not formed") as failure:
            sender.wait_for_receivers(timeout_s=SHORT_S)
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
    context = mp.get_context("spawn")
    sender = TorchDistributedWeightSender(timeout_s=LONG_S)
    spec = sender.open_group(["learner", "engine-0", "engine-1"])
    events = context.Queue()
    processes = [
        context.Process(target=_flaky_receiver, args=(spec.to_dict(), name, events), daemon=True)
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
    context = mp.get_context("spawn")
    sender = TorchDistributedWeightSender(timeout_s=LONG_S)
    spec = sender.open_group(["learner", "engine-0", "engine-1"])
    events = context.Queue()
    processes = [
        context.Process(target=_dying_receiver, args=(spec.to_dict(), name, events), daemon=True)
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
