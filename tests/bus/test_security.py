"""CURVE: keys from tools/keygen.py let peers talk; a peer without the right key delivers nothing."""

from __future__ import annotations

import asyncio
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from bus.broadcast import Publisher, Subscriber
from bus.rpc import RpcClient, RpcServer, RpcTimeout
from bus.schema import Ack, Control, Heartbeat, LeaseRenew
from bus.security import CurveKeyError, CurveKeys, Security, generate_cluster_keys
from bus.sockets import peer_name
from bus.stream import StreamReceiver, StreamSender

REPO = Path(__file__).resolve().parents[2]


async def _ack(client: str, request: object) -> Ack:
    return Ack(ok=True, error=peer_name(client))


@pytest.mark.integration
def test_keygen_writes_a_loadable_pair_with_a_private_secret(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "tools.keygen", str(tmp_path / "keys")],
                            capture_output=True, text=True, check=True)  # fmt: skip
    keys = CurveKeys.load(tmp_path / "keys")
    assert keys.public.decode() in result.stdout and len(keys.public) == 40 and len(keys.secret) == 40
    assert stat.S_IMODE(os.stat(tmp_path / "keys" / "cluster.key_secret").st_mode) == 0o600
    again = subprocess.run([sys.executable, "-m", "tools.keygen", str(tmp_path / "keys")],
                           capture_output=True, text=True)  # fmt: skip
    assert again.returncode == 1 and "exists" in again.stderr
    assert CurveKeys.load(tmp_path / "keys") == keys, "a refused keygen must not replace the keys"


@pytest.mark.unit
def test_loading_keys_from_an_empty_directory_says_how_to_make_them(tmp_path: Path) -> None:
    with pytest.raises(CurveKeyError, match=r"key_secret: no cluster secret key; create one with tools/keygen\.py"):
        CurveKeys.load(tmp_path)


@pytest.mark.unit
def test_a_key_directory_that_does_not_exist_is_named(tmp_path: Path) -> None:
    with pytest.raises(CurveKeyError, match=rf"^{re.escape(str(tmp_path / 'absent'))}: no such directory"):
        CurveKeys.load(tmp_path / "absent")


@pytest.mark.unit
@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o602, 0o644, 0o666], ids=lambda mode: f"{mode:04o}")
def test_a_secret_key_that_group_or_others_can_read_or_write_is_refused_with_the_fix(
    tmp_path: Path, mode: int
) -> None:
    generate_cluster_keys(tmp_path)
    secret = tmp_path / "cluster.key_secret"
    os.chmod(secret, mode)
    with pytest.raises(CurveKeyError) as refused:
        CurveKeys.load(tmp_path)
    assert str(refused.value) == (f"{secret}: secret key file is accessible by group or others (mode {mode:04o}); "
                                  f"fix with: chmod 600 {secret}")
    os.chmod(secret, 0o400)  # owner-only, read-only: fine
    assert CurveKeys.load(tmp_path).secret


@pytest.mark.unit
def test_a_key_directory_without_the_public_file_is_refused(tmp_path: Path) -> None:
    generate_cluster_keys(tmp_path)
    (tmp_path / "cluster.key").unlink()
    with pytest.raises(CurveKeyError, match=rf"^{re.escape(str(tmp_path / 'cluster.key'))}: no cluster public key"):
        CurveKeys.load(tmp_path)


@pytest.mark.unit
def test_a_public_file_from_another_pair_is_refused(tmp_path: Path) -> None:
    generate_cluster_keys(tmp_path / "a")
    generate_cluster_keys(tmp_path / "b")
    os.replace(tmp_path / "b" / "cluster.key", tmp_path / "a" / "cluster.key")
    with pytest.raises(CurveKeyError, match=r"cluster\.key: public key does not match .*cluster\.key_secret"):
        CurveKeys.load(tmp_path / "a")


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_secret_key_that_is_not_a_regular_file_is_refused(tmp_path: Path, kind: str) -> None:
    generate_cluster_keys(tmp_path)
    secret = tmp_path / "cluster.key_secret"
    secret.unlink()
    secret.mkdir(mode=0o700) if kind == "directory" else os.mkfifo(secret, 0o600)
    expected = "a directory" if kind == "directory" else "a FIFO"
    with pytest.raises(CurveKeyError, match=rf"^{re.escape(str(secret))}: not a regular file \({expected}\)"):
        CurveKeys.load(tmp_path)  # a FIFO would block a reader forever: it must be refused before it is opened


@pytest.mark.unit
def test_a_secret_key_that_is_not_a_certificate_is_refused(tmp_path: Path) -> None:
    generate_cluster_keys(tmp_path)
    (tmp_path / "cluster.key_secret").write_text("not a certificate")
    with pytest.raises(CurveKeyError, match=r"cluster\.key_secret: not a valid CURVE certificate"):
        CurveKeys.load(tmp_path)


@pytest.mark.integration
@pytest.mark.parametrize("problem", ["loose", "no_public", "missing_dir"])
def test_the_launcher_refuses_bad_keys_in_one_line_before_any_actor_starts(tmp_path: Path, problem: str) -> None:
    keys = tmp_path / "keys"
    generate_cluster_keys(keys)
    if problem == "loose":
        os.chmod(keys / "cluster.key_secret", 0o644)
        expected = f"launcher.py: error: --curve-keys: {keys / 'cluster.key_secret'}: secret key file is accessible"
    elif problem == "no_public":
        (keys / "cluster.key").unlink()
        expected = f"launcher.py: error: --curve-keys: {keys / 'cluster.key'}: no cluster public key"
    else:
        keys = tmp_path / "absent"
        expected = f"launcher.py: error: --curve-keys: {keys}: no such directory"
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, str(REPO / "launcher.py"), "--head", "--curve-keys", str(keys),
                             "--run-dir", str(run_dir), "--no-progress"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(expected) and result.stderr.count("\n") == 1, result.stderr
    assert not run_dir.exists(), "no actor may start (nor the run directory be made) with bad keys"


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
async def test_broadcasts_reach_subscribers_with_the_cluster_key_and_no_one_else(
    zctx: zmq.asyncio.Context, cluster: Security
) -> None:
    """The publisher's socket refuses frames longer than a subscription; CURVE's handshake must still pass it."""
    publisher = Publisher(zctx, "tcp://127.0.0.1:0", security=cluster)
    trusted = Subscriber(zctx, publisher.endpoint, ["control"], security=cluster)
    strangers = [Subscriber(zctx, publisher.endpoint, ["control"], security=None),
                 Subscriber(zctx, publisher.endpoint, ["control"],
                            security=Security(cluster.cluster, client=CurveKeys.generate()))]
    heard = [asyncio.create_task(stranger.recv()) for stranger in strangers]
    publisher.publish("control", Control(command="pause"))  # replayed to each subscriber that joins later
    assert await asyncio.wait_for(trusted.recv(), 5) == ("control", Control(command="pause"))
    await asyncio.sleep(0.3)
    assert not any(task.done() for task in heard) and cluster.refused > 0
    for task in heard:
        task.cancel()
    for channel in (trusted, *strangers, publisher):
        channel.close()
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
    # The authenticator is asked only once a client proved it holds a key pair: a plaintext peer fails earlier.
    assert cluster.refused > 0 if intruder == "wrong_key" else cluster.refused == 0
    inbox.cancel()
    raw.close(linger=0)
    for channel in (client, sender, receiver, server):
        channel.close()
    await serving
    cluster.close()
