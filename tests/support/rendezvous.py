"""A torch.distributed rendezvous for test processes on this machine, with no port to race for.

`free_port()` then `init_method="tcp://...:{port}"` in a spawned process leaves a window in which another test
takes the port (EADDRINUSE in CI). A file store has a fresh path per call and nothing to bind."""

from __future__ import annotations

import tempfile
import uuid
from pathlib import Path


def rendezvous_file() -> str:
    """An `init_method` for one process group: a file store at a path no other group uses."""
    return f"file://{Path(tempfile.gettempdir()) / f'slipstream-rendezvous-{uuid.uuid4().hex}'}"
