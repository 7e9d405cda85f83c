"""The sleeping trainer's hold: a tool keeps a simulated run alive until it is done with it (tools/hostile waits so
for its attack to be judged), instead of padding the run with steps that outlast the slowest machine."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tools.sim.pipeline import SimSpec


@pytest.mark.unit
def test_a_hold_without_a_file_to_wait_for_is_refused() -> None:
    with pytest.raises(ValueError, match="hold_at_version 3 needs a release_file"):
        SimSpec(hold_at_version=3)


@pytest.mark.unit
def test_the_held_step_trains_only_once_its_release_file_exists(tmp_path: Path) -> None:
    from tools.sim.learner import SleepingTrainer

    release = tmp_path / "release"
    trainer = SleepingTrainer(0.0, hold_at_version=2, release_file=release)
    assert trainer.train_step([], None, temperature=1.0).version == 1  # before the hold: at once
    finished = threading.Event()
    versions: list[int] = []

    def held_step() -> None:
        versions.append(trainer.train_step([], None, temperature=1.0).version)
        finished.set()

    thread = threading.Thread(target=held_step, daemon=True)
    thread.start()
    assert not finished.wait(0.3) and not versions, "the held step trained before its release"
    release.touch()
    assert finished.wait(30) and versions == [2]
    assert trainer.train_step([], None, temperature=1.0).version == 3  # released for good
