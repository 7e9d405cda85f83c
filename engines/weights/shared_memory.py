"""Same-host weight transfer on the CPU: shared-memory files in place of a gloo broadcast.

Engines on the learner's host (a colocated run, the CPU demo) can read the learner's memory, so the bytes need
not cross loopback TCP twice. The staging buffers of `staged_copy.py` are files in /dev/shm (RAM), mapped shared
by the learner and by every receiver. The last receiver to map a file unlinks its name: the mappings outlive the
name, and a learner killed afterwards leaves nothing behind in /dev/shm.

A handle is JSON: the file's path, its size and the learner's host name, so an engine on another host is told
that this transport needs the learner's host rather than failing on a missing file.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from engines.weights.staged_copy import StagedCopyGroup

SHM_DIR = Path("/dev/shm")


class SharedMemoryGroup(StagedCopyGroup):
    transport = "shm"

    def __init__(self, store: dist.Store, rank: int, size: int, timeout_s: float) -> None:
        super().__init__(store, rank, size, timeout_s)
        self._token = uuid.uuid4().hex[:8]
        self._files: dict[str, Path] = {}  # sender: allocation key -> its file, until unlinked

    def _check_tensor(self, tensor: Tensor) -> None:
        if tensor.device.type != "cpu":
            raise RuntimeError(f"shm broadcast of a {tensor.device} tensor; the transport moves CPU tensors")

    def _allocate(self, key: str, nbytes: int) -> tuple[Tensor, list[bytes]]:
        path = _directory() / f"slipstream-weights-{os.getpid()}-{self._token}-{key}"
        buffer = _map(path, nbytes)
        self._files[key] = path
        handle = json.dumps({"path": str(path), "nbytes": nbytes, "host": socket.gethostname()}).encode()
        return buffer, [handle] * (self.size - 1)

    def _open(self, handle: bytes) -> Tensor:
        described = json.loads(handle)
        path, host = Path(described["path"]), described["host"]
        if host != socket.gethostname():
            raise RuntimeError(f"shm weight transport: the learner is on host {host!r}, this engine on "
                               f"{socket.gethostname()!r}; shared memory needs the learner's host (use gloo or nccl)")
        if not path.exists():
            raise RuntimeError(f"shm weight transport: {path} is gone (the learner replaced or removed it)")
        buffer = _map(path, int(described["nbytes"]))
        if self.store.add(f"opened/{path.name}", 1) == self.size - 1:
            path.unlink(missing_ok=True)  # every receiver maps it now: the name is no longer needed
        return buffer

    def _retire(self, key: str) -> None:
        path = self._files.pop(key, None)
        if path is not None:
            path.unlink(missing_ok=True)

    def close(self) -> None:
        for key in list(self._files):
            self._retire(key)


def _directory() -> Path:
    """RAM-backed /dev/shm where there is one (Linux); elsewhere the temporary directory, still shared."""
    return SHM_DIR if SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK) else Path(tempfile.gettempdir())


def _map(path: Path, nbytes: int) -> Tensor:
    storage = torch.UntypedStorage.from_file(str(path), shared=True, nbytes=nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage)
