"""The checkpoint directory: `latest` names the current checkpoint, and --keep-last-checkpoints deletes the oldest
of the learner's own checkpoints, never the current one nor anything else kept beside them."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.runtime.checkpoint_pointer import latest_checkpoint, point_latest_at, prune_checkpoints, step_checkpoint

pytestmark = pytest.mark.unit


def checkpoints(directory: Path, *steps: int) -> list[Path]:
    made = []
    for step in steps:
        path = step_checkpoint(directory, step)
        path.mkdir(parents=True)
        (path / "state.json").write_text("{}")
        made.append(path)
    return made


def names(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


def test_the_oldest_checkpoints_go_once_latest_names_the_new_one(tmp_path: Path) -> None:
    *_, newest = checkpoints(tmp_path, 2, 4, 6, 8)
    point_latest_at(tmp_path, newest)
    deleted = prune_checkpoints(tmp_path, 2, newest)
    assert [path.name for path in deleted] == ["step_000002", "step_000004"]
    assert names(tmp_path) == ["latest", "step_000006", "step_000008"]
    assert latest_checkpoint(tmp_path) == newest


def test_keeping_one_leaves_only_the_checkpoint_just_saved(tmp_path: Path) -> None:
    *_, newest = checkpoints(tmp_path, 1, 2, 3)
    point_latest_at(tmp_path, newest)
    prune_checkpoints(tmp_path, 1, newest)
    assert names(tmp_path) == ["latest", "step_000003"]


def test_the_checkpoint_latest_names_is_never_deleted(tmp_path: Path) -> None:
    """`latest` still names an older checkpoint (the new one's pointer move did not happen): that one stays."""
    current, _, newest = checkpoints(tmp_path, 1, 2, 3)
    point_latest_at(tmp_path, current)
    prune_checkpoints(tmp_path, 1, newest)
    assert names(tmp_path) == ["latest", "step_000001", "step_000003"]


def test_only_the_learners_older_checkpoints_are_candidates(tmp_path: Path) -> None:
    """A user's folders and files beside the checkpoints, a staging folder, and a checkpoint newer than the one just
    saved (an earlier life of the learner wrote it past the checkpoint it resumed from) are all left alone."""
    _, saved, abandoned = checkpoints(tmp_path, 1, 2, 3)
    for folder in ("notes", "step_old", ".step_000002.staging-1-abc"):
        (tmp_path / folder).mkdir()
    (tmp_path / "step_000000").write_text("a file, not a checkpoint")
    point_latest_at(tmp_path, saved)
    prune_checkpoints(tmp_path, 1, saved)
    assert names(tmp_path) == [".step_000002.staging-1-abc", "latest", "notes", "step_000000", "step_000002",
                               "step_000003", "step_old"]
    assert abandoned.is_dir()


@pytest.mark.parametrize("keep", [0, -1])
def test_keeping_fewer_than_one_checkpoint_is_refused(tmp_path: Path, keep: int) -> None:
    (newest,) = checkpoints(tmp_path, 1)
    with pytest.raises(ValueError, match=f"keep {keep} must be >= 1"):
        prune_checkpoints(tmp_path, keep, newest)
    assert newest.is_dir()
