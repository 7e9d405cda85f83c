"""Where a run's checkpoints live and which one is current: the `latest` file the learner moves once a checkpoint
is complete. Shared by the learner (which writes, prunes and resumes from it) and the launcher (which names it
when a run is interrupted or its head is lost), and free of torch, which the launcher never imports."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

LATEST = "latest"
STEP_NAME = re.compile(r"^step_(\d{6,})$")  # the learner's checkpoints, and nothing else a user keeps beside them


def checkpoint_dir(save: str | None, run_dir: Path) -> Path:
    """--save, else RUN_DIR/checkpoints."""
    return Path(save) if save else run_dir / "checkpoints"


def step_checkpoint(directory: Path, trained_batch: int) -> Path:
    """Where the checkpoint after `trained_batch` batches goes."""
    return directory / f"step_{trained_batch:06d}"


def resume_source(load: str | None, save: str | None, run_dir: Path) -> Path:
    """Where a starting learner looks for the checkpoint to resume from: --load when given, else where it saves."""
    return Path(load) if load else checkpoint_dir(save, run_dir)


def latest_checkpoint(directory: Path) -> Path | None:
    """The checkpoint `latest` names in `directory`; None where there is none (or it cannot be read)."""
    try:
        name = (directory / LATEST).read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return directory / name if name else None


def point_latest_at(directory: Path, checkpoint: Path) -> None:
    """Move `latest` to `checkpoint` so that a reader finds the old name or the new one, never an empty file: a
    learner killed while `latest` was being rewritten would otherwise fail to restart until someone repaired it.
    Returns once the move (and the checkpoint's own rename into `directory`) is on disk."""
    pointer = directory / LATEST
    partial = pointer.with_name(LATEST + ".partial")
    with open(partial, "w", encoding="utf-8") as handle:
        handle.write(checkpoint.name)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, pointer)
    _fsync_directory(directory)


def prune_checkpoints(directory: Path, keep: int, saved: Path) -> list[Path]:
    """Delete the learner's checkpoints older than `saved` beyond the newest `keep` (`saved` counted); returns
    those deleted. Call it only once `latest` names `saved` durably (`point_latest_at`): the checkpoint `latest`
    names is never deleted, whatever it is, nor anything but `step_N` folders. Those newer than `saved` are left
    alone: an earlier life of the learner wrote them past the checkpoint it resumed from, and the run overwrites
    them as it gets there."""
    newest = checkpoint_step(saved)
    if keep < 1 or newest is None:
        raise ValueError(f"prune_checkpoints: keep {keep} must be >= 1 and {saved} a step_N checkpoint")
    current = latest_checkpoint(directory)
    older = sorted((path for path in directory.iterdir()
                    if path.is_dir() and (step := checkpoint_step(path)) is not None and step < newest),
                   key=lambda path: checkpoint_step(path) or 0)
    doomed = [path for path in older[: max(0, len(older) - (keep - 1))]
              if current is None or path.name != current.name]
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def checkpoint_step(path: Path) -> int | None:
    """The step a `step_checkpoint` was taken after (the batches it holds); None for a folder named otherwise."""
    match = STEP_NAME.match(path.name)
    return int(match.group(1)) if match else None


def checkpoint_at_step(folder: Path, step: int, flag: str) -> Path:
    """The checkpoint taken at `step` in a folder of checkpoints (slime's `--ref-ckpt-step`): Megatron's
    `iter_NNNNNNN` (slime's `--save` folders) or the learner's `step_NNNNNN`. The error names the flag and lists the
    steps the folder holds."""
    names = (f"iter_{step:07d}", f"step_{step:06d}")
    for name in names:
        if (folder / name).is_dir():
            return folder / name
    found = sorted(path.name for path in folder.iterdir()
                   if path.is_dir() and (path.name.startswith("iter_") or STEP_NAME.match(path.name))
                   ) if folder.is_dir() else []
    raise ValueError(f"{flag} {step}: {folder} holds no checkpoint of that step ({' or '.join(names)}); "
                     f"its steps: {', '.join(found) or 'none'}")


def _fsync_directory(directory: Path) -> None:
    """Make the renames inside `directory` durable (a power loss could otherwise undo them)."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
