"""What tools/hostile/campaign.py sends: every hostile kind that applies to each bound socket, as planned attacks.

An ``Attack`` is one kind against one socket: the messages, the routing id of each connection that carries them
(``hostile-KIND#nonce``, so the receiver's per-peer drop table attributes them), or, for the kinds below what a
ZeroMQ socket can send, a raw-wire function (tools/hostile/wire.py). Planning is deterministic for a seed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from actors.buffer.log import BufferLog
from bus.broadcast import PUBLISHER_FRAME_LIMIT
from bus.codec import DEFAULT_LIMITS, encode
from bus.rpc import REQUEST_LIMITS
from bus.schema import EngineAbort, Heartbeat, LeaseRenew
from bus.sockets import routing_id
from tools.hostile import wire
from tools.hostile.run import Endpoint, Run

REPLAY_REPEATS = 5
FRAME_LIMITS = {"inbox": DEFAULT_LIMITS.max_frame_bytes, "rpc": REQUEST_LIMITS.max_frame_bytes,
                "engine": REQUEST_LIMITS.max_frame_bytes, "publish": PUBLISHER_FRAME_LIMIT}
# Request/reply sockets: an actor's "rpc", and a rollout worker's "engine" (its engine served to the other workers).
RPC_CHANNELS = ("rpc", "engine")


@dataclass(frozen=True)
class Mode:
    """How much to send: ``scale`` frames per kind per socket, over ``connections`` connections per kind."""

    name: str
    scale: int
    connections: int
    raw_connections: int
    registers: int
    steps: int


QUICK = Mode("quick", scale=250, connections=4, raw_connections=8, registers=40, steps=24)
FULL = Mode("full", scale=2000, connections=16, raw_connections=30, registers=200, steps=200)


@dataclass
class Attack:
    """One kind against one socket: the messages to send, over which connections, and what came of it."""

    endpoint: Endpoint
    kind: str
    messages: list[wire.Frames] = field(default_factory=list)
    idents: list[bytes] = field(default_factory=list)  # one per connection
    label: str = ""  # the receiver's peer label for these connections
    raw: Callable[[Endpoint, random.Random], bool] | None = None  # a raw-wire attack: True if the peer hung up
    sent: int = 0
    unsent: int = 0
    closed: int = 0
    answered: int = 0
    counted: str = ""
    ok: bool = False
    missing: int = 0  # frames sent but not found under this attack's own rows (negative: more found than sent)

    @property
    def frames(self) -> int:
        return self.sent if self.raw is None else len(self.idents)


def plan(endpoints: list[Endpoint], mode: Mode, rng: random.Random, actor_ids: list[str],
         captured: list[bytes]) -> list[Attack]:
    """Every kind that applies to each socket."""
    attacks: list[Attack] = []
    for endpoint in endpoints:
        if endpoint.channel == "publish":
            attacks += _publisher_attacks(endpoint, mode, rng)
            continue
        attacks += _router_attacks(endpoint, mode, rng, actor_ids, captured)
        attacks += _raw_attacks(endpoint, mode, ("oversized", "bad_greeting", "unfinished"))
    return attacks


def _labelled(endpoint: Endpoint, kind: str, connections: int) -> Attack:
    name = f"hostile-{kind}"
    return Attack(endpoint, kind, idents=[routing_id(name, "hostile") for _ in range(connections)], label=name)


def _router_attacks(endpoint: Endpoint, mode: Mode, rng: random.Random, actor_ids: list[str],
                    captured: list[bytes]) -> list[Attack]:
    n, rpc = mode.scale, endpoint.channel in RPC_CHANNELS

    def message(payload: bytes) -> wire.Frames:
        return [rng.randbytes(16), payload] if rpc else [payload]

    attacks = []
    for kind, make in wire.PAYLOADS.items():
        attack = _labelled(endpoint, kind, mode.connections)
        attack.messages = [message(make(rng)) for _ in range(n)]
        attacks.append(attack)
    envelope = _labelled(endpoint, "envelope", mode.connections)
    envelope.messages = [wire.rpc_envelope(rng) if rpc else wire.stream_envelope(rng) for _ in range(n)]
    attacks.append(envelope)
    # Real names, as plain ids and with made-up nonces (a second connection may not reuse a live routing id).
    names = [name for name in actor_ids if name != endpoint.actor]
    identity = Attack(endpoint, "identity", label="(real actor names)",
                      idents=[name.encode() if index < len(names) else
                              f"{name}#{rng.randbytes(8).hex()}".encode()
                              for index, name in enumerate(names * 2)])
    identity.messages = [message(wire.random_payload(rng)) for _ in range(n)]
    attacks.append(identity)
    # At least 8 random bytes: a ROUTER ignores a second connection with a live routing id (below the actor).
    idents = Attack(endpoint, "idents", label="(random ids)",
                    idents=[bytes([rng.randint(1, 255)]) + rng.randbytes(rng.randint(7, 30))
                            for _ in range(max(8, n // 5))])
    idents.messages = [message(wire.random_payload(rng)) for _ in range(n)]
    attacks.append(idents)
    replay = _labelled(endpoint, "replay", mode.connections)
    if rpc:
        # Every copy of a request id on the connection that first sent it: message i goes out on connection i % C.
        request, connections = _valid_request(endpoint), len(replay.idents)
        per_id = math.ceil(n / REPLAY_REPEATS / connections)
        per_connection = [[[rid, request] for rid in [rng.randbytes(16) for _ in range(per_id)]
                           for _ in range(REPLAY_REPEATS)] for _ in range(connections)]
        replay.messages = [per_connection[i % connections][i // connections]
                           for i in range(connections * len(per_connection[0]))]
    elif captured:
        replay.messages = [[wire.hello_frame(rng)] for _ in range(mode.connections)]  # delivered, not abuse
        replay.messages += [[rng.choice(captured)] for _ in range(n)]
    attacks.append(replay)
    if not rpc:
        no_hello = _labelled(endpoint, "no_hello", mode.connections)
        no_hello.messages = [[wire.unhandled_data(seq)] for seq in range(n)]
        credit = _labelled(endpoint, "credit", mode.connections)
        credit.messages = [[wire.credit_frame(rng)] for _ in range(n)]
        hellos = _labelled(endpoint, "hellos", 1)
        hellos.messages = [[wire.hello_frame(rng)] for _ in range(n)]
        attacks += [no_hello, credit, hellos]
    if endpoint.actor == "controller":
        claims = _labelled(endpoint, "claims", mode.connections)
        claims.messages = [[rng.randbytes(16), wire.identity_claims(actor_ids, rng)] for _ in range(n)]
        registers = _labelled(endpoint, "registers", 2)
        registers.messages = [[rng.randbytes(16), wire.random_registration(rng)] for _ in range(mode.registers)]
        attacks += [claims, registers]
    return attacks


def _valid_request(endpoint: Endpoint) -> bytes:
    """A request the server answers without effect: refused or unhandled, so replays can only be duplicates."""
    if endpoint.actor == "controller":
        return encode(Heartbeat(actor_id="hostile-replay", seq=1))  # not registered: refused
    if endpoint.channel == "engine":
        return encode(EngineAbort(request_id="hostile-replay"))  # no such request: nothing to abort
    return encode(LeaseRenew(lease_id="hostile-replay"))  # the buffer holds no such lease; a rollout serves none


def _publisher_attacks(endpoint: Endpoint, mode: Mode, rng: random.Random) -> list[Attack]:
    n = mode.scale
    subs = _labelled(endpoint, "subs", mode.connections * 4)
    subs.messages = [[wire.subscription(rng)] for _ in range(n)]
    not_sub = _labelled(endpoint, "not_sub", mode.connections)
    not_sub.messages = [[wire.not_a_subscription(rng)] for _ in range(n)]
    envelope = _labelled(endpoint, "pub_envelope", mode.connections)
    envelope.messages = [[wire.not_a_subscription(rng), wire.not_a_subscription(rng)] for _ in range(n)]
    return [subs, not_sub, envelope, *_raw_attacks(endpoint, mode, ("oversized", "bad_greeting"))]


def _raw_attacks(endpoint: Endpoint, mode: Mode, kinds: tuple[str, ...]) -> list[Attack]:
    makers = {"oversized": _oversized, "bad_greeting": _bad_greeting, "unfinished": _unfinished}
    return [Attack(endpoint, kind, idents=[b""] * mode.raw_connections, raw=makers[kind], label="-")
            for kind in kinds]


def _socket_type(endpoint: Endpoint) -> bytes:
    return b"XSUB" if endpoint.channel == "publish" else b"DEALER"


def _oversized(endpoint: Endpoint, rng: random.Random) -> bool:
    peer = wire.RawZmtp(endpoint.address, _socket_type(endpoint), b"hostile-oversized")
    try:
        peer.handshake()
        peer.send(wire.long_frame_header(FRAME_LIMITS[endpoint.channel] + 1) + rng.randbytes(1024))
        return peer.closed_by_peer()
    finally:
        peer.close()


def _bad_greeting(endpoint: Endpoint, rng: random.Random) -> bool:
    peer = wire.RawZmtp(endpoint.address, _socket_type(endpoint))
    try:
        peer.send(wire.bad_greeting(rng))
        return peer.closed_by_peer()
    finally:
        peer.close()


def _unfinished(endpoint: Endpoint, rng: random.Random) -> bool:
    peer = wire.RawZmtp(endpoint.address, _socket_type(endpoint), b"hostile-unfinished")
    try:
        peer.handshake()
        peer.send(b"".join(wire.short_frame(rng.randbytes(200), more=True) for _ in range(50)))
        return False  # we hang up: libzmq discards the half message with the connection
    finally:
        peer.close()


def captured_frames(run: Run, limit: int = 64) -> list[bytes]:
    """Real ScoredGroup frames, exactly as they crossed the wire, from the buffer's durable log."""
    path = run.run_dir / "buffer" / "log.msgpack"
    frames = [record["group"] for record in BufferLog.replay(path) if record.get("kind") == "accept"]
    return frames[:limit]
