"""What a user needs to go on with a stopped run: the step it stopped at, the step a resumed run starts from, and
the command that resumes it (docs/reliability.md, "Stopping and resuming a run").

A run resumes when the launcher starts again on its run directory: the learner loads its latest checkpoint, the
buffer replays its log. The launcher's default run directory is a new timestamped folder, so "the same command"
resumes only with `--run-dir` added, which `resume_command` does. In a run of several policies each policy's
learner resumes from its own checkpoints, in its own directory (RUN_DIR/policies/<name>/checkpoints), and each
buffer replays its own log there: the note says where each policy stopped.
"""

from __future__ import annotations

import shlex
import shutil
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from actors.config import RunConfig
from actors.launch.policy_scopes import Scope
from actors.runtime.checkpoint_pointer import checkpoint_step, latest_checkpoint, resume_source
from actors.runtime.metrics import last_record


def resume_step(config: RunConfig, run_dir: Path) -> int:
    """The step of the checkpoint a learner starting now resumes from: it trains from the step after; 0 for none."""
    checkpoint = latest_checkpoint(resume_source(config.learner.load, config.learner.save, run_dir))
    return (checkpoint_step(checkpoint) or 0) if checkpoint is not None else 0


def resume_command(program: str, arguments: Sequence[str], run_dir: Path, *, run_dir_given: bool) -> str:
    """The command line this launcher was started with, with `--run-dir` added where it was not given: runnable
    as printed from the directory the run was started in."""
    python = "python" if shutil.which("python") == sys.executable else _short(Path(sys.executable))
    extra = [] if run_dir_given else ["--run-dir", _short(run_dir)]
    return shlex.join([python, program, *arguments, *extra])


def interrupted_note(learners: Sequence[Scope], signum: int, command: str) -> str:
    """Printed last by a launcher a signal stopped: where the run stopped, where it resumes (`learners`: the scopes of
    the learners on this node, each policy's in its own directory; none on a node without one), and how."""
    name = signal.Signals(signum).name
    if not learners:
        return f"launcher.py: interrupted by {name}.\nresume with: {command}"
    if len(learners) == 1 and learners[0].policy is None:
        return f"launcher.py: interrupted by {name} {_stopped_at(learners[0])}.\nresume with: {command}"
    places = "; ".join(f"policy {scope.policy} {_stopped_at(scope)}" for scope in learners)
    return f"launcher.py: interrupted by {name}: {places}.\nresume with: {command}"


def _stopped_at(scope: Scope) -> str:
    """Where a learner stopped and where it resumes, from its metrics and checkpoints in its run directory."""
    config, run_dir = scope.config, scope.run_dir
    record = last_record(run_dir / "metrics" / "train.jsonl")
    trained = int(record["step"]) if record is not None and isinstance(record.get("step"), int) else None
    checkpoint = latest_checkpoint(resume_source(config.learner.load, config.learner.save, run_dir))
    resumed = checkpoint_step(checkpoint) if checkpoint is not None else None
    total = config.learner.num_rollout
    if trained is None and checkpoint is None:
        return "before its first step"
    if checkpoint is None:
        return f"at step {trained} of {total}, before its first checkpoint: a resumed run trains from step 1"
    if resumed is None or trained is None or resumed >= trained:
        return f"at step {resumed if resumed is not None else trained} of {total}, checkpoint {checkpoint}"
    # trained further than its checkpoint (killed before it could save): those steps are trained again
    return (f"at step {trained} of {total}; its last checkpoint is {checkpoint}: a resumed run trains from "
            f"step {resumed + 1}")


def _short(path: Path) -> str:
    """`path` relative to the working directory when it lies under it (`runs/20250101-120000`), else absolute."""
    absolute = path.resolve() if not path.is_absolute() else path
    try:
        return str(absolute.relative_to(Path.cwd()))
    except ValueError:
        return str(absolute)
