"""A node's learner ranks wait the run's --restart-backoff before a fresh set, as the launcher does for an actor."""

from __future__ import annotations

from pathlib import Path

import pytest

import launcher
from actors.runtime.restarts import RestartPolicy
from tests.support.launch_inputs import minimal_inputs


@pytest.mark.unit
def test_a_fresh_rank_set_waits_the_runs_restart_backoff_doubling_while_sets_end_quickly() -> None:
    backoff = RestartPolicy(backoff_initial_s=0.2).backoff
    assert [backoff(ends) for ends in (1, 2, 3, 4)] == pytest.approx([0.2, 0.4, 0.8, 1.6])
    assert backoff(20) == RestartPolicy().backoff_max_s == 30.0
    assert RestartPolicy(backoff_initial_s=0.0).backoff(3) == 0.0


@pytest.mark.unit
def test_the_launcher_hands_every_actor_the_runs_restart_backoff(tmp_path: Path) -> None:
    contexts, _, _ = launcher.prepare(["--head", "--run-dir", str(tmp_path / "run"), *minimal_inputs(tmp_path),
                                       "--restart-backoff", "0.2"])
    assert {context.settings.restart_backoff for context in contexts} == {0.2}
