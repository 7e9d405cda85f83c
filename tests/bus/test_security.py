"""CURVE: keys from tools/keygen.py let peers talk; a peer without the right key delivers nothing."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from bus.rpc import RpcClient, RpcServer, RpcTimeout
from bus.schema import Ack, Heartbeat, LeaseRenew
from bus.security import CurveKeys, Security, generate_cluster_keys
from bus.sockets import peer_name
from bus.stream import StreamReceiver, StreamSender

REPO = Path(__file__).resolve().parents[2]


async def _ack(client: str, request: object) -> Ack:
    return Ack(ok=True, error=peer_name(client))


@pytest.mark.integration
def test_keygen_writes_a_loadable_pair_with_a_private_secret(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(REPO / "tools/keygen.py"), str(tmp_path / "keys")],
                            capture_output=True, text=True, check=True)  # fmt: skip
    keys = CurveKeys.load(tmp_path / "keys")
    assert keys.public.decode() in result.stdout and len(keys.public) == 40 and len(keys.secret) == 40
    assert stat.S_IMODE(os.stat(tmp_path / "keys" / "cluster.key_secret").st_mode) == 0o600
    again = subprocess.run([sys.executable, str(REPO / "tools/keygen.py"), str(tmp_path / "keys")],
                           capture_output=True, text=True)  # fmt: skip
    assert again.returncode == 1 and "exists" in again.stderr
    assert CurveKeys.load(tmp_path / "keys") == keys, "a refused keygen must not replace the keys"


@pytest.mark.unit
def test_loading_keys_from_an_empty_directory_says_how_to_make_them(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"create one with tools/keygen\.py"):
        CurveKeys.load(tmp_path)


@pytest.fixture
def cluster(tmp_path: Path) -> Security:
    return Security(generate_cluster_keys(tmp_path / "keys"))


@pytest.mark.integration
async def test_peers_with_the_cluster_key_talk_over_curve(zctx: zmq.asyncio.Context, cluster: Security) -> None:
    server = RpcServer(zctx, "tcp://127.0.0.1:0", security=cluster)
    serving = asyncio.create_task(server.serve(_ack))
    client = RpcClient(zctx, server.endpoint, client_id="trusted", security=cluster)
    assert await client.call(LeaseRenew(lease_id="L"), timeout=2) == Ack(ok=True, error="trusted")
    receiver = StreamReceiver(zctx, "tcp://127.0.0.1:0", security=cluster)
    sender = StreamSender(zctx, sender_id="trusted", security=cluster)
    sender.connect("r", receiver.endpoint)
    sending = asyncio.create_task(sender.send(Heartbeat(actor_id="trusted", seq=1), timeout=5))
    assert (await asyncio.wait_for(receiver.recv(), 5))[0] == "trusted"
    await sending
    for channel in (client, sender, receiver, server):
        channel.close()
    await serving
    cluster.close()


@pytest.mark.integration
@pytest.mark.parametrize("intruder", ["wrong_key", "plaintext"])
async def test_a_client_without_the_cluster_key_delivers_nothing(
    zctx: zmq.asyncio.Context, cluster: Security, intruder: str
) -> None:
    handled: list[object] = []

    async def record(client: str, request: object) -> Ack:
        handled.append(request)
        return Ack()

    server = RpcServer(zctx, "tcp://127.0.0.1:0", security=cluster)
    serving = asyncio.create_task(server.serve(record))
    receiver = StreamReceiver(zctx, "tcp://127.0.0.1:0", security=cluster)
    inbox = asyncio.create_task(receiver.recv())
    # A stranger knows the server's public key (it is not secret) but holds its own key pair.
    stranger = Security(cluster.cluster, client=CurveKeys.generate()) if intruder == "wrong_key" else None
    client = RpcClient(zctx, server.endpoint, client_id="mallory", security=stranger)
    with pytest.raises(RpcTimeout):
        await client.call(LeaseRenew(lease_id="steal"), timeout=0.3, retries=1)
    sender = StreamSender(zctx, sender_id="mallory", security=stranger)
    sender.connect("r", receiver.endpoint)
    with pytest.raises(asyncio.TimeoutError):
        await sender.send(Heartbeat(actor_id="mallory", seq=1), timeout=0.5)
    raw = zctx.socket(zmq.DEALER)  # and a raw socket pushing a frame with no handshake at all
    raw.connect(receiver.endpoint)
    await raw.send(b"\x80")
    await asyncio.sleep(0.2)
    assert handled == [] and not inbox.done() and receiver.received == 0 and not receiver.dropped
    inbox.cancel()
    raw.close(linger=0)
    for channel in (client, sender, receiver, server):
        channel.close()
    await serving
    cluster.close()
