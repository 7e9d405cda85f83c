"""Endpoint strings: what to bind, and what to tell others to connect to.

Channels bind ``tcp://HOST:0`` (the OS picks a free port) or an ``ipc://`` path, then advertise the real
address read back from the socket, so no two actors ever race for a port number.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
import tempfile
from pathlib import Path
from typing import Literal

import zmq

WILDCARD_HOSTS = ("0.0.0.0", "*", "::", "[::]")


def default_run_dir() -> Path:
    """Per-user directory for ipc sockets (short, because ipc paths are limited to 107 bytes)."""
    return Path(tempfile.gettempdir()) / f"slipstream-{os.getuid()}"


SOCKET_NAME_BUDGET = 32  # bytes kept free below a sockets folder for "ACTOR-CHANNEL.sock" ("rollout-0-12-inbox.sock")


def ipc_sockets_dir(run_dir: str | Path) -> Path:
    """Where a run's ipc sockets live: `RUN_DIR/sockets`, unless that path leaves too few of the OS's 107 bytes for
    a socket's name; then a short folder keyed by the run directory, under `default_run_dir()`. A deep run
    directory (a job scheduler's, a test runner's) would otherwise fail every actor's bind."""
    preferred = Path(run_dir) / "sockets"
    if len(str(preferred).encode()) + 1 + SOCKET_NAME_BUDGET <= zmq.IPC_PATH_MAX_LEN:
        return preferred
    key = hashlib.blake2b(str(Path(run_dir).resolve()).encode(), digest_size=6).hexdigest()
    return default_run_dir() / f"run-{key}"


def bind_address(
    host: str = "127.0.0.1",
    transport: Literal["tcp", "ipc"] = "tcp",
    run_dir: str | Path | None = None,
    name: str | None = None,
) -> str:
    """An address to bind: ``tcp://host:0`` or ``ipc://run_dir/name.sock`` (run_dir is created)."""
    if transport == "tcp":
        if not host:
            raise ValueError("bind_address: host must not be empty (use 127.0.0.1, a host IP, or 0.0.0.0)")
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"tcp://{host}:0"
    if transport == "ipc":
        directory = Path(run_dir) if run_dir is not None else default_run_dir()
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{name or secrets.token_hex(6)}.sock"
        if len(str(path).encode()) > zmq.IPC_PATH_MAX_LEN:
            raise ValueError(
                f"bind_address: ipc path {str(path)!r} is {len(str(path).encode())} bytes, the OS limit is "
                f"{zmq.IPC_PATH_MAX_LEN}; use a shorter run_dir"
            )
        return f"ipc://{path}"
    raise ValueError(f"bind_address: transport must be 'tcp' or 'ipc', got {transport!r}")


def bind(sock: zmq.Socket, address: str) -> str:
    """Bind ``sock`` to ``address`` and return the endpoint peers should connect to."""
    if not address.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"cannot bind {address!r}: expected tcp://HOST:PORT, ipc://PATH or inproc://NAME")
    if address.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    try:
        sock.bind(address)
    except zmq.ZMQError as exc:
        raise OSError(f"cannot bind {address}: {exc}") from exc
    return connectable(sock.getsockopt_string(zmq.LAST_ENDPOINT))


def connectable(endpoint: str) -> str:
    """Replace a wildcard bind host with this machine's address so the endpoint works from other nodes."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    if host in WILDCARD_HOSTS:
        try:
            host = socket.gethostbyname(socket.gethostname())
        except OSError:
            host = "127.0.0.1"
    return f"tcp://{host}:{port}"


def ephemeral_port_range() -> tuple[int, int]:
    """The ports the kernel gives outgoing connections (Linux's net.ipv4.ip_local_port_range; its default
    elsewhere)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now, below the kernel's ephemeral range: the callers bind it later, often in another
    process (a run's head address, a learner's rank store, a weight group), again at each restart. An ephemeral
    port, the OS's pick for a bind to port 0, may be given to any outgoing connection on the node meanwhile (seen:
    a two-node learner's rank store port and a controller's head port taken before they were bound); outgoing
    connections never get a port below the range. Whoever binds it next may still race us for it."""
    low = ephemeral_port_range()[0]
    candidates = list(range(max(1024, low - 16384), low))
    secrets.SystemRandom().shuffle(candidates)
    for port in candidates[:256]:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))  # nothing free below the range: the OS's pick
        return probe.getsockname()[1]
