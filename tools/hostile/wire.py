"""The hostile bytes of tools/hostile/campaign.py: frame makers per attack kind, and a raw ZMTP 3.0 client.

Most attacks go through ordinary pyzmq sockets: the frames are hostile, the framing is not, so they reach the
receiving actor's code and must be counted there. A few attacks are below what a ZeroMQ socket lets a client
do, and need the raw client here: a frame header claiming more bytes than the receiver's limit (libzmq must
refuse it before allocating, and drop the connection), a broken greeting, and a multipart message that is never
finished. Every maker is deterministic for a given ``random.Random``.
"""

from __future__ import annotations

import random
import socket
import struct
from collections.abc import Callable

import msgpack

from bus.codec import encode
from bus.schema import (
    TOPIC_CONTROL,
    TOPIC_ROSTER,
    TOPIC_RUN_STATE,
    TOPIC_VERSION,
    Heartbeat,
    LeaseRenew,
    LeaseRequest,
    Leave,
    Register,
    StateReport,
    StreamCredit,
    StreamHello,
    VersionAnnouncement,
)

Frames = list[bytes]  # one multipart message, routing id excluded (the DEALER adds it)

# Real messages whose encodings are cut short by the "truncated" kind.
_TEMPLATES = [
    encode(Heartbeat(actor_id="rollout-0-0", seq=12, counters={"dropped.inbox.bad_msgpack": 3.0})),
    encode(LeaseRequest(worker_id="rollout-0-1", max_groups=4)),
    encode(Register(actor_id="reward-0-0", role="reward", node="host#0", pid=4242,
                    endpoints={"inbox": "tcp://127.0.0.1:5555"})),
    encode(StreamHello(sender_id="reward-0-0", session="0123456789abcdef")),
    encode(VersionAnnouncement(version=7, weights_version=7, step=7)),
]

# Known types with fields of the wrong type, unknown types, and wrong versions: valid msgpack maps every one.
_WRONG_TYPES: list[dict[str, object]] = [
    {"type": "LeaseRequest", "v": 1, "worker_id": 5, "max_groups": "four"},
    {"type": "Heartbeat", "v": 1, "actor_id": ["learner"], "seq": 1.5},
    {"type": "Heartbeat", "v": 1, "actor_id": "learner", "seq": 1, "counters": {"x": "not a float"}},
    {"type": "ScoredGroup", "v": 1, "lease_id": 1, "group_id": None, "samples": "none", "worker_id": 3},
    {"type": "Register", "v": 1, "actor_id": "x", "role": "reward", "node": "n", "pid": "1", "endpoints": []},
    {"type": "WeightUpdateOrder", "v": 1, "version": "7", "group": [1, 2]},
    {"type": "StreamHello", "v": 1, "sender_id": 7, "session": {"a": 1}},
    {"type": "Control", "v": 1, "command": "explode"},
    {"type": "BatchRequest", "v": 1, "learner_version": -1.5},
    {"type": "Shutdown", "v": 1, "now": True},
    {"type": "Heartbeat", "v": 99, "actor_id": "learner", "seq": 1},
    {"type": "Heartbeat", "actor_id": "learner", "seq": 1},
    {"v": 1, "actor_id": "learner"},
]


def random_payload(rng: random.Random) -> bytes:
    """Random bytes that are never a valid message (a map needs 0x8X/0xDE/0xDF first; those are avoided)."""
    body = rng.randbytes(rng.randint(0, 200))
    if body[:1] and (body[0] & 0xF0 == 0x80 or body[0] in (0xDE, 0xDF)):
        body = b"\xc1" + body[1:]  # 0xc1 is never used in msgpack
    return body


def truncated_payload(rng: random.Random) -> bytes:
    template = rng.choice(_TEMPLATES)
    return template[: rng.randrange(1, len(template))]


def wrong_types_payload(rng: random.Random) -> bytes:
    return msgpack.packb(rng.choice(_WRONG_TYPES))


PAYLOADS: dict[str, Callable[[random.Random], bytes]] = {
    "random": random_payload,
    "truncated": truncated_payload,
    "wrong_types": wrong_types_payload,
}


def stream_envelope(rng: random.Random) -> Frames:
    """A stream frame is one part: two or more are the wrong shape."""
    return [random_payload(rng) for _ in range(rng.randint(2, 4))]


def rpc_envelope(rng: random.Random) -> Frames:
    """An RPC request is [request_id (1..64 bytes), message]: everything else."""
    message = encode(LeaseRenew(lease_id="hostile"))
    shapes = [
        [message],  # no request id
        [rng.randbytes(8), message, message],  # one part too many
        [b"", message],  # empty request id
        [rng.randbytes(65), message],  # request id over 64 bytes
    ]
    return rng.choice(shapes)


def credit_frame(rng: random.Random) -> bytes:
    """A StreamCredit, which only a receiver may send, sent to a receiver."""
    return encode(StreamCredit(limit=rng.randint(1, 1 << 30), window=16, incarnation="spoof", session="spoof"))


def hello_frame(rng: random.Random) -> bytes:
    """A StreamHello opening a fresh session each time: the receiver answers every one with a credit."""
    return encode(StreamHello(sender_id="hostile-hellos", session=rng.randbytes(8).hex()))


def unhandled_data(seq: int) -> bytes:
    """Valid data no inbox handles; sent without a hello, it is credit abuse."""
    return encode(Heartbeat(actor_id="hostile-no_hello", seq=seq))


def identity_claims(actor_ids: list[str], rng: random.Random) -> bytes:
    """A valid request to the controller in the name of a real, live actor: each must be refused.

    The controller itself is a real actor that never registers: only a registration in its name is a claim.
    """
    actor = rng.choice(actor_ids)
    # A role no peer follows: should a claim ever be admitted, the run is told of it, not harmed by it.
    register = encode(Register(actor_id=actor, role="hostile", node="attacker#0", pid=1, endpoints={}))
    if actor == "controller":
        return register
    return rng.choice([
        encode(Heartbeat(actor_id=actor, seq=rng.randint(1, 1000), counters={"spoofed": 1.0})),
        register,
        encode(Leave(actor_id=actor, reason="spoofed")),
        encode(StateReport(actor_id=actor, stacks="spoofed")),
        encode(VersionAnnouncement(version=10**6, step=10**6)),
    ])  # fmt: skip


def random_registration(rng: random.Random) -> bytes:
    """A registration of a name nobody has, with a role no peer follows: admitted without CURVE keys."""
    name = f"hostile-{rng.randbytes(6).hex()}"
    return encode(Register(actor_id=name, role="hostile", node="attacker#0", pid=rng.randint(2, 1 << 22),
                           endpoints={}))


def subscription(rng: random.Random) -> bytes:
    """A subscription: mostly random topics (each a new trie branch), some real topics and everything."""
    choice = rng.random()
    if choice < 0.1:
        return b"\x01"
    if choice < 0.3:
        return b"\x01" + rng.choice([TOPIC_CONTROL, TOPIC_ROSTER, TOPIC_RUN_STATE, TOPIC_VERSION]).encode()
    return b"\x01" + rng.randbytes(rng.randint(1, 32))


def not_a_subscription(rng: random.Random) -> bytes:
    """Anything upstream of a publisher that is not a (un)subscription: the first byte is neither 0 nor 1."""
    return bytes([rng.randint(2, 255)]) + rng.randbytes(rng.randint(0, 30))


# ------------------------------------------------------------------------------------------ raw ZMTP 3.0
def _greeting() -> bytes:
    return b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" + bytes(31)


def _property(name: bytes, value: bytes) -> bytes:
    return bytes([len(name)]) + name + struct.pack(">I", len(value)) + value


def _command(body: bytes) -> bytes:
    return b"\x04" + bytes([len(body)]) + body


def long_frame_header(size: int, more: bool = False) -> bytes:
    """The header of a ZMTP frame that claims ``size`` bytes (the long form: flags, then a u64 size)."""
    return bytes([0x02 | (0x01 if more else 0)]) + struct.pack(">Q", size)


def short_frame(data: bytes, more: bool = False) -> bytes:
    return bytes([0x01 if more else 0x00, len(data)]) + data


class RawZmtp:
    """A TCP connection that speaks just enough ZMTP 3.0 (NULL mechanism) to send arbitrary frames."""

    def __init__(self, endpoint: str, socket_type: bytes, identity: bytes = b"", timeout: float = 5.0) -> None:
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        self.sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
        self._socket_type = socket_type
        self._identity = identity

    def handshake(self) -> None:
        ready = b"\x05READY" + _property(b"Socket-Type", self._socket_type)
        if self._identity:
            ready += _property(b"Identity", self._identity)
        self.sock.sendall(_greeting() + _command(ready))

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def closed_by_peer(self, timeout: float = 5.0) -> bool:
        """Read until the peer closes (True) or stays silent for ``timeout`` seconds (False)."""
        self.sock.settimeout(timeout)
        try:
            while self.sock.recv(65536):
                pass
        except TimeoutError:
            return False
        except OSError:
            return True  # reset
        return True

    def close(self) -> None:
        self.sock.close()


def bad_greeting(rng: random.Random) -> bytes:
    """A ZMTP 3.0 signature and version with a mechanism nobody speaks: the handshake must fail."""
    return b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + rng.randbytes(20) + b"\0" + bytes(31)
