"""Nodes of a cluster on one machine, for multi-node tests: each node is a network namespace with one interface
and its own address, cabled by a veth pair to a bridge in a hub namespace. Nothing is reachable from a node but
the other nodes (and its own loopback), so traffic between launchers crosses the veth cables as it would cross a
network between machines. Processes are started in a node with `ip netns exec`; the filesystem stays shared, as a
cluster's run directory is.

Creating namespaces needs root (or CAP_SYS_ADMIN and CAP_NET_ADMIN) and iproute2: `unavailable_reason()` says
why not where it cannot, so the test skips with that reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

SUBNET = "10.213.0"  # private, and only ever configured inside the namespaces made here
INTERFACE = "eth0"


class NetnsError(RuntimeError):
    pass


@dataclass(frozen=True)
class Node:
    namespace: str
    address: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this node."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def pids(self) -> list[int]:
        """Every process in this node, whatever started it."""
        listed = _ip("netns", "pids", self.namespace, check=False).stdout.split()
        return [int(pid) for pid in listed if pid.isdigit()]

    def kill(self) -> None:
        """kill -9 of the whole node at once, as a power cut would (`stop_then_kill`)."""
        stop_then_kill(self.pids())

    def cable_bytes(self) -> int:
        """Bytes this node sent and received over its cable (not over its loopback)."""
        stats = Path("/sys/class/net") / INTERFACE / "statistics"
        read = _ip("netns", "exec", self.namespace, "cat", str(stats / "rx_bytes"), str(stats / "tx_bytes"))
        return sum(int(value) for value in read.stdout.split())


def stop_then_kill(pids: list[int]) -> None:
    """SIGKILL of every pid as one event: all are stopped first, so none reacts to another's death in between (an
    actor whose launcher died first gets SIGTERM from its death signal and would leave the roster cleanly)."""
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be made here (None when they can): tried, not guessed."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = f"sl-probe-{uuid.uuid4().hex[:8]}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace (`ip netns add`: {made.stderr.strip() or made.returncode})"
    veth = _ip("-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1", check=False)
    _ip("netns", "delete", probe, check=False)
    if veth.returncode != 0:
        return f"cannot create a veth pair in a network namespace: {veth.stderr.strip()}"
    return None


@contextlib.contextmanager
def cluster(nodes: int) -> Iterator[list[Node]]:
    """`nodes` namespaces on one bridge, addresses SUBNET.1, .2, ...; all removed on exit (with the processes
    still in them)."""
    tag = uuid.uuid4().hex[:6]
    hub = f"sl-{tag}-hub"
    made: list[str] = []
    members = [Node(namespace=f"sl-{tag}-n{index}", address=f"{SUBNET}.{index + 1}") for index in range(nodes)]
    try:
        _ip("netns", "add", hub)
        made.append(hub)
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "link", "set", "br0", "up")
        for index, node in enumerate(members):
            _ip("netns", "add", node.namespace)
            made.append(node.namespace)
            _ip("-n", node.namespace, "link", "set", "lo", "up")
            cable = f"sl{tag}c{index}"  # interface names stop at 15 characters
            _ip("-n", hub, "link", "add", cable, "type", "veth", "peer", "name", INTERFACE, "netns", node.namespace)
            _ip("-n", hub, "link", "set", cable, "master", "br0", "up")
            _ip("-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", INTERFACE)
            _ip("-n", node.namespace, "link", "set", INTERFACE, "up")
        yield members
    finally:
        for node in members:
            if node.namespace in made:
                node.kill()
        for namespace in reversed(made):  # deleting a namespace deletes its ends of the cables, and the bridge
            _ip("netns", "delete", namespace, check=False)


def _ip(*arguments: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *arguments], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise NetnsError(f"ip {' '.join(arguments)}: {done.stderr.strip() or f'exit {done.returncode}'}")
    return done
