"""Fixtures for the bus tests: a zmq asyncio context and bind addresses on tcp loopback or ipc."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
import zmq.asyncio


@pytest.fixture
def zctx() -> Iterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def ipc_dir() -> Iterator[Path]:
    """A short directory for ipc sockets (pytest's tmp_path can exceed the 107-byte ipc path limit)."""
    path = Path(tempfile.mkdtemp(prefix="bus-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=["tcp", "ipc"])
def bind(request: pytest.FixtureRequest, ipc_dir: Path) -> str:
    """A bind address for each transport."""
    return "tcp://127.0.0.1:0" if request.param == "tcp" else f"ipc://{ipc_dir}/channel.sock"
