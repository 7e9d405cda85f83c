"""Where a run's checkpoints live and which one is current: the `latest` file the learner moves once a checkpoint
is complete. Shared by the learner (which writes and resumes from it) and a worker node's launcher (which names it
when the head is lost), and free of torch, which the launcher never imports."""

from __future__ import annotations

import os
from pathlib import Path

LATEST = "latest"


def checkpoint_dir(save: str | None, run_dir: Path) -> Path:
    """--save, else RUN_DIR/checkpoints."""
    return Path(save) if save else run_dir / "checkpoints"


def latest_checkpoint(directory: Path) -> Path | None:
    """The checkpoint `latest` names in `directory`; None where there is none (or it cannot be read)."""
    try:
        name = (directory / LATEST).read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return directory / name if name else None


def point_latest_at(directory: Path, checkpoint: Path) -> None:
    """Move `latest` to `checkpoint` so that a reader finds the old name or the new one, never an empty file: a
    learner killed while `latest` was being rewritten would otherwise fail to restart until someone repaired it."""
    pointer = directory / LATEST
    partial = pointer.with_name(LATEST + ".partial")
    with open(partial, "w", encoding="utf-8") as handle:
        handle.write(checkpoint.name)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, pointer)
