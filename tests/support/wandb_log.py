"""Read back what an offline W&B run wrote: its history, as W&B's own protobuf records.

The `.wandb` file is a LevelDB-style log: 32 KiB blocks whose records carry a 7-byte header, so a record that
crosses a block edge is split in two. Searching the raw bytes for a value fails whenever that value straddles
an edge; decoding the records does not.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

FILE_HEADER = 7  # b":W&B", a 2-byte magic, a version byte
BLOCK = 32 * 1024
RECORD_HEADER = 7  # crc32c (4), length (2, little-endian), type (1)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def payloads(path: Path) -> list[bytes]:
    """Every record's bytes, chunks joined, in the order W&B wrote them."""
    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a W&B transaction log (header {data[:4]!r})")
    records: list[bytes] = []
    pending = b""
    offset = FILE_HEADER
    while offset + RECORD_HEADER <= len(data):
        room = BLOCK - offset % BLOCK
        if room < RECORD_HEADER:  # a block's tail too short for a header is padding
            offset += room
            continue
        length = int.from_bytes(data[offset + 4 : offset + 6], "little")
        kind = data[offset + 6]
        if offset + RECORD_HEADER + length > len(data):
            break  # a record W&B is still writing
        chunk = data[offset + RECORD_HEADER : offset + RECORD_HEADER + length]
        offset += RECORD_HEADER + length
        if kind == 0 and length == 0:
            continue  # zero padding at the end of a block
        if kind == FULL:
            records.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            records.append(pending + chunk)
            pending = b""
        else:
            raise ValueError(f"{path}: record type {kind} at byte {offset - RECORD_HEADER - length}")
    return records


def history(run_dir: Path) -> list[dict[str, Any]]:
    """Every history row W&B recorded under `run_dir/wandb`, across all of the run's resumptions, oldest first.

    Rows are ordered by their own timestamps: a resumption started within the same second as the run before it
    gets a directory name that sorts before that run's.
    """
    from wandb.proto import wandb_internal_pb2

    rows: list[dict[str, Any]] = []
    for path in sorted((run_dir / "wandb").rglob("*.wandb")):
        if path.parent.name == "latest-run":
            continue  # a link to one of the others
        for payload in payloads(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return sorted(rows, key=lambda row: row["_timestamp"])


def settled_history(run_dir: Path, ready: Callable[[list[dict[str, Any]]], bool], timeout_s: float = 30.0
                    ) -> list[dict[str, Any]]:
    """`history(run_dir)` once `ready` says it is complete, or as it is at the deadline.

    W&B's offline writer is a separate process that finishes the `.wandb` file after `run.finish()` returns: read
    at once, the file can still lack the last records (seen under load: a restarted run's whole history)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = history(run_dir)
        if ready(rows) or time.monotonic() >= deadline:
            return rows
        time.sleep(0.1)
