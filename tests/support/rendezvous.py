"""A torch.distributed rendezvous for test processes on this machine, with no port to race for.

`free_port()` then `init_method="tcp://...:{port}"` in a spawned process leaves a window in which another test
takes the port (EADDRINUSE in CI). A file store has a fresh path per call and nothing to bind."""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path


def rendezvous_file() -> str:
    """An `init_method` for one process group: a file store at a path no other group uses."""
    return f"file://{Path(tempfile.gettempdir()) / f'slipstream-rendezvous-{uuid.uuid4().hex}'}"


@contextlib.contextmanager
def cpu_gloo_rank(rank: int, rendezvous: str, world: int) -> Iterator[None]:
    """A spawned test rank in a gloo world of `world`, one thread, no GPU (hidden before CUDA initialises, so
    megatron takes its CPU path on a CUDA machine too); the group is destroyed on the way out, failure or not."""
    import torch
    import torch.distributed as dist

    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
