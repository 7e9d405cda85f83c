"""What a process listens on, for tests that check which interfaces a component binds."""

from __future__ import annotations

import contextlib
import os
import socket

import pytest


def listening() -> set[tuple[str, int]]:
    """The TCP addresses this process listens on, read from /proc (its socket inodes, matched in the tables)."""
    if not os.path.exists("/proc/net/tcp"):
        pytest.skip("needs Linux's /proc/net/tcp")
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile (the listing's own descriptor, for one)
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[len("socket:[") : -1])
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/net/{table}", encoding="ascii") as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                (address, port), state, inode = fields[1].split(":"), fields[3], fields[9]
                if state == "0A" and inode in inodes:  # 0A: LISTEN
                    raw = bytes.fromhex(address)  # 32-bit words in host (little-endian) order
                    packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                    found.add((socket.inet_ntop(family, packed), int(port, 16)))
    return found
