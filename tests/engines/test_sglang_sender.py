"""The learner's SGLang weight sender when a server will not receive: it must fail the transfer, never hang or die.

The peer is a real process that joins the weight group as an SGLang server rank does and then never posts the
receive, as a server does when it refuses `/update_weights_from_distributed` before receiving (SGLang 0.5.23
outside a weight-update session). With `refuse`, it also writes the error acknowledgement our loader writes
when its server refused a bucket.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engines.sglang.weights import SglangWeightSender
from engines.weights.base import WeightTransferError

ENGINE = "rollout-0-0"
REPO = Path(__file__).resolve().parents[2]
PEER = """
import json, sys, time
from engines.sglang.weight_group import join_weight_group
from engines.sglang.weight_store import ERROR_PREFIX, READY, SglangGroupSpec, connect_keys
args = json.loads(sys.argv[1])
spec = SglangGroupSpec.from_dict(args["spec"])
group = join_weight_group(backend="gloo", master_address=spec.master_address, master_port=spec.master_port,
                          rank=spec.rank_offset(args["engine"]), world_size=spec.world_size,
                          group_name=spec.group_name, timeout_s=60)
keys = connect_keys(spec, args["version"], 60)
keys.set("ready/" + args["engine"], READY)
keys.wait(["go"])
if args["refuse"]:
    keys.set("ack/" + args["engine"], ERROR_PREFIX + b"update_weights_from_distributed must run between "
             b"begin_weight_update() and end_weight_update()")
time.sleep(120)
"""


def start_peer(sender: SglangWeightSender, version: int, *, refuse: bool) -> subprocess.Popen[bytes]:
    spec = sender.open_group(["learner", ENGINE])
    arguments = json.dumps({"spec": spec.to_dict(), "engine": ENGINE, "version": version, "refuse": refuse})
    peer = subprocess.Popen([sys.executable, "-c", PEER, arguments], cwd=REPO)
    # The peer imports torch before it joins, which takes seconds on a loaded machine: the join gets its own
    # deadline, longer than the transfer deadline the tests measure.
    sender.wait_for_receivers(timeout_s=60)
    return peer


@pytest.fixture
def peers() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for peer in started:
        peer.kill()
        peer.wait()


# 64 MiB: far more than socket buffers hold, so the broadcast cannot complete without a receiver.
WEIGHTS = [("model.embed_tokens.weight", torch.ones(4096, 4096))]


@pytest.mark.integration
def test_a_refused_bucket_fails_the_transfer_at_once_not_at_the_group_timeout(
    peers: list[subprocess.Popen[bytes]],
) -> None:
    sender = SglangWeightSender(host="127.0.0.1", backend="gloo", timeout_s=60)
    try:
        peers.append(start_peer(sender, 1, refuse=True))
        started = time.monotonic()
        with pytest.raises(WeightTransferError, match=r"bucket 1/1 failed") as failure:
            sender.send(WEIGHTS, 1)
        assert time.monotonic() - started < 15  # the deadline is 60 s and the group's own timeout 180 s
        assert "begin_weight_update" in failure.value.failed[ENGINE]
        assert sender.committed_version is None
        with pytest.raises(WeightTransferError, match="not usable"):
            sender.send(WEIGHTS, 2)  # the group is abandoned; the learner opens a new one
    finally:
        sender.close()


@pytest.mark.integration
def test_a_bucket_nobody_receives_fails_at_the_senders_deadline(peers: list[subprocess.Popen[bytes]]) -> None:
    sender = SglangWeightSender(host="127.0.0.1", backend="gloo", timeout_s=3)
    try:
        peers.append(start_peer(sender, 1, refuse=False))
        started = time.monotonic()
        with pytest.raises(WeightTransferError, match=r"bucket 1/1 failed") as failure:
            sender.send(WEIGHTS, 1)
        assert 3 <= time.monotonic() - started < 20  # the group's own timeout is 66 s
        assert "not received within 3s" in failure.value.failed[ENGINE]
        # The learner carries on: a new group forms (and fails the same way against the same silent peer).
        peers.append(start_peer(sender, 2, refuse=True))
        with pytest.raises(WeightTransferError, match=r"bucket 1/1 failed"):
            sender.send(WEIGHTS, 2)
    finally:
        sender.close()
