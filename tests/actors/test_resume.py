"""Resuming a stopped run, as the user sees it: the stopped launcher names the step and the command that resumes
the run, and the resumed launcher's progress starts at the step it resumed from and shows every step to the end."""

from __future__ import annotations

import asyncio
import json
import shlex
import signal
from pathlib import Path

import pytest

from actors.config import RunConfig
from actors.launch.policy_scopes import Scope, policy_scopes
from actors.launch.resume import interrupted_note, resume_command, resume_step
from actors.report.progress import Followed, ProgressStart, follow_learners, follow_progress
from actors.runtime.checkpoint_pointer import checkpoint_dir, point_latest_at, step_checkpoint

pytestmark = pytest.mark.unit


def trained(run_dir: Path, *steps: int) -> None:
    path = run_dir / "metrics" / "train.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        handle.writelines(json.dumps({"step": step, "time": float(step), "rollout/reward_mean": 0.5}) + "\n"
                          for step in steps)


def checkpointed(run_dir: Path, step: int) -> Path:
    directory = checkpoint_dir(None, run_dir)
    target = step_checkpoint(directory, step)
    target.mkdir(parents=True)
    point_latest_at(directory, target)
    return target


def test_the_resume_command_names_the_run_directory_the_default_made(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The default run directory is a new timestamped folder: the same command again would start a new run."""
    monkeypatch.chdir(tmp_path)
    arguments = ["--head", "--prompt-data", "my data.jsonl", "--num-rollout", "40"]
    command = shlex.split(resume_command("launcher.py", arguments, tmp_path / "runs" / "20250101-120000",
                                         run_dir_given=False))
    assert command[1:] == ["launcher.py", *arguments, "--run-dir", "runs/20250101-120000"]
    given = shlex.split(resume_command("launcher.py", [*arguments, "--run-dir", "/data/run"], Path("/data/run"),
                                       run_dir_given=True))
    assert given[1:] == ["launcher.py", *arguments, "--run-dir", "/data/run"]


def test_an_interrupted_run_says_its_step_its_checkpoint_and_how_to_resume(tmp_path: Path) -> None:
    config = RunConfig().with_settings(num_rollout=40)
    trained(tmp_path, 1, 2, 3, 4)
    checkpoint = checkpointed(tmp_path, 4)
    note = interrupted_note([Scope(None, config, tmp_path)], signal.SIGINT, "python launcher.py --run-dir r")
    assert note == (f"launcher.py: interrupted by SIGINT at step 4 of 40, checkpoint {checkpoint}.\n"
                    "resume with: python launcher.py --run-dir r")


def test_steps_past_the_last_checkpoint_are_said_to_be_trained_again(tmp_path: Path) -> None:
    """A second Ctrl-C kills the learner before its stop checkpoint: the resumed run trains those steps again."""
    config = RunConfig().with_settings(num_rollout=40)
    trained(tmp_path, *range(1, 15))
    checkpoint = checkpointed(tmp_path, 12)
    note = interrupted_note([Scope(None, config, tmp_path)], signal.SIGINT, "c")
    assert f"at step 14 of 40; its last checkpoint is {checkpoint}: a resumed run trains from step 13" in note
    before = interrupted_note([Scope(None, config, tmp_path / "fresh")], signal.SIGTERM, "c")
    assert before.startswith("launcher.py: interrupted by SIGTERM before its first step.")


async def test_a_resumed_runs_progress_starts_at_its_checkpoint(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The earlier start trained to step 14 and checkpointed step 12; the resumed learner trains step 13 next."""
    config = RunConfig().with_settings(num_rollout=40)
    trained(tmp_path, *range(1, 15))
    checkpointed(tmp_path, 12)
    start = ProgressStart.of(tmp_path, resume_step(config, tmp_path))  # as the launcher takes it, before actors
    trained(tmp_path, 13)  # the resumed learner's first step
    stop = asyncio.Event()
    follower = asyncio.create_task(follow_progress(tmp_path, 40, stop, start))
    shown = ""

    async def shown_step_13() -> None:
        nonlocal shown
        while "step 13 " not in shown:
            shown += capsys.readouterr().err
            await asyncio.sleep(0.05)

    await asyncio.wait_for(shown_step_13(), timeout=30)
    stop.set()
    await follower
    lines = shown.splitlines()
    assert lines[0] == "[progress] resumed from step 12 of 40"
    assert [line.split()[2] for line in lines[1:]] == ["13"]  # none of the earlier start's steps 1..14


async def test_the_steps_of_a_runs_last_second_are_shown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The launcher stops the display when the actors are done; steps written since its last look still show."""
    trained(tmp_path, 5, 6)
    stop = asyncio.Event()
    stop.set()
    await follow_progress(tmp_path, 6, stop)
    assert [line.split()[2] for line in capsys.readouterr().err.splitlines()] == ["5", "6"]


def test_a_new_run_resumes_from_no_step(tmp_path: Path) -> None:
    assert resume_step(RunConfig(), tmp_path) == 0
    assert ProgressStart.of(tmp_path, 0) == ProgressStart(offset=0, resumed_from=0)


def test_a_node_without_a_learner_says_only_how_to_resume() -> None:
    assert interrupted_note([], signal.SIGTERM, "c") == "launcher.py: interrupted by SIGTERM.\nresume with: c"


TWO_POLICIES = RunConfig(lora_rank=4, num_rollout=40, policies={"solver": {}, "proposer": {"num_rollout": 10}})


def test_each_policy_resumes_from_its_own_checkpoints_and_the_note_says_where_each_stopped(tmp_path: Path) -> None:
    solver, proposer = policy_scopes(TWO_POLICIES, tmp_path)
    trained(solver.run_dir, 1, 2, 3, 4)
    checkpoint = checkpointed(solver.run_dir, 4)
    trained(proposer.run_dir, 1, 2)  # and no checkpoint yet
    assert (resume_step(solver.config, solver.run_dir), resume_step(proposer.config, proposer.run_dir)) == (4, 0)
    assert checkpoint.is_relative_to(tmp_path / "policies" / "solver")
    note = interrupted_note([solver, proposer], signal.SIGINT, "c")
    assert note == (f"launcher.py: interrupted by SIGINT: policy solver at step 4 of 40, checkpoint {checkpoint}; "
                    "policy proposer at step 2 of 10, before its first checkpoint: a resumed run trains from step 1."
                    "\nresume with: c")


async def test_the_progress_of_several_policies_names_each_policys_steps(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    solver, proposer = policy_scopes(TWO_POLICIES, tmp_path)
    trained(solver.run_dir, 1, 2, 3)
    checkpointed(solver.run_dir, 2)
    followed = [Followed(scope.run_dir, scope.config.learner.num_rollout, policy=scope.policy,
                         start=ProgressStart.of(scope.run_dir, resume_step(scope.config, scope.run_dir)))
                for scope in (solver, proposer)]  # as the launcher takes them, before its actors start
    trained(solver.run_dir, 3)
    trained(proposer.run_dir, 1)
    stop = asyncio.Event()
    stop.set()  # the run's last look: every line written since the starts is shown
    await follow_learners(followed, stop)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "[progress] solver: resumed from step 2 of 40"
    assert [line.split()[1:4] for line in lines[1:]] == [["solver:", "step", "3"], ["proposer:", "step", "1"]]
