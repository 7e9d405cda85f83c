"""The buffer's durable log: what was leased, accepted, dropped, served and committed, in order.

Append-only msgpack records, flushed (and fsynced at batch boundaries) as they happen, so a buffer that is
killed and restarted replays the log into exactly the state it had: groups leased but never returned are
re-issued, accepted groups not yet trained go back to the pool, and batches served but not yet covered by a
learner checkpoint are served again identically. A torn last record (kill -9 mid-write) is ignored.

Compaction keeps a long run's restart fast: once the log passes a size (and has doubled since the last compaction),
the buffer writes its whole state as one "snapshot" record into a fresh log that replaces the old one atomically.
The old log is kept beside it as `log.msgpack.<n>` (hard-linked before the swap, so at every instant `log.msgpack`
is a complete log); only audits read the archives, so they may be deleted to reclaim disk.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack


class BufferLog:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "ab")  # noqa: SIM115 - held open for the buffer's lifetime

    def append(self, kind: str, *, sync: bool = False, **fields: Any) -> None:
        self._file.write(msgpack.packb({"kind": kind, **fields}, use_bin_type=True))
        self._file.flush()
        if sync:
            os.fsync(self._file.fileno())

    def size(self) -> int:
        return self._file.tell()

    def compact(self, snapshot: dict[str, Any]) -> Path:
        """Replace the log with one snapshot record; returns where the previous log was archived."""
        fresh = self.path.with_name(self.path.name + ".compacting")
        with open(fresh, "wb") as handle:
            handle.write(msgpack.packb({"kind": "snapshot", **snapshot}, use_bin_type=True))
            handle.flush()
            os.fsync(handle.fileno())
        archive = self.path.with_name(f"{self.path.name}.{len(archived_logs(self.path)) + 1}")
        self._file.close()
        os.link(self.path, archive)
        os.replace(fresh, self.path)
        directory = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
        self._file = open(self.path, "ab")  # noqa: SIM115 - held open for the buffer's lifetime
        return archive

    def close(self) -> None:
        self._file.close()

    @staticmethod
    def replay(path: Path) -> Iterator[dict[str, Any]]:
        if not path.exists():
            return
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=1 << 30)
        with open(path, "rb") as handle:
            while chunk := handle.read(1 << 20):
                unpacker.feed(chunk)
                while True:
                    try:
                        record = unpacker.unpack()
                    except msgpack.OutOfData:
                        break
                    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
                        return  # a torn or corrupt tail: everything before it is intact
                    if isinstance(record, dict) and "kind" in record:
                        yield record


def archived_logs(path: Path) -> list[Path]:
    """Logs replaced by compactions, oldest first; with `path` last they hold the run's whole history."""
    numbered = [p for p in path.parent.glob(path.name + ".*") if p.suffix[1:].isdigit()]
    return sorted(numbered, key=lambda p: int(p.suffix[1:]))
