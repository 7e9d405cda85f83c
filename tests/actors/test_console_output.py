"""What an actor prints on the terminal it shares with the launcher and every other actor of its node: its own
records, each a whole line, and none of what libraries print by themselves (progress bars, C++ stack traces)."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from actors.launch.zygote_client import Zygote
from actors.runtime.context import ActorContext
from tests.support.console import PROGRESS_BAR, env_without_quiet_switches

REPO = Path(__file__).resolve().parents[2]
CPP_STACK_TRACE = ("Exception raised from", "frame #")


def launcher_env(**extra: str) -> dict[str, str]:
    """The environment the launcher gives an actor, without any of the switches the actor must set itself."""
    return env_without_quiet_switches(PYTHONUNBUFFERED="1", **extra)


def probe_context(tmp_path: Path) -> Path:
    context = ActorContext(actor_id="probe", role="probe", actor_class="tests.support.console_probe:Missing",
                           node_rank=0, head_address="tcp://127.0.0.1:1", run_dir=tmp_path)
    path = tmp_path / "probe.json"
    path.write_text(context.to_json(), encoding="utf-8")
    return path


def run_new_interpreter(context: Path, env: dict[str, str]) -> tuple[int, str]:
    completed = subprocess.run([sys.executable, "-m", "actors.runtime.main", str(context)], cwd=REPO, env=env,
                               capture_output=True, text=True, timeout=240, check=False)
    return completed.returncode, completed.stderr


def run_forked(context: Path, env: dict[str, str], capfd: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """Forked from a template that imported torch and transformers first (heavy), with the launcher's env."""

    async def scenario() -> int:
        zygote = await Zygote.start(env)
        try:
            child = await zygote.spawn(str(context), env, heavy=True)
            return await asyncio.wait_for(child.wait(), 240)
        finally:
            await zygote.close()

    capfd.readouterr()
    code = asyncio.run(scenario())
    return code, capfd.readouterr().err


@pytest.mark.integration
def test_an_actor_loading_and_saving_a_model_prints_no_progress_bar(tmp_path: Path, tiny_model_path: Path) -> None:
    env = launcher_env(CONSOLE_PROBE="load_model", CONSOLE_PROBE_MODEL=str(tiny_model_path))
    code, stderr = run_new_interpreter(probe_context(tmp_path), env)
    assert code == 2, stderr  # the probe has no actor class: it ends right after its import did the work
    assert "probe: model saved and loaded" in stderr
    assert not PROGRESS_BAR.search(stderr), stderr


@pytest.mark.integration
@pytest.mark.parametrize("start", ["new-interpreter", "forked-from-template"])
def test_a_lost_distributed_peer_is_reported_without_a_cpp_stack_trace(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], start: str
) -> None:
    """A learner killed mid-run: the processes waiting on its rendezvous store report the error in one line,
    not c10d's C++ warning with some twenty stack frames (set before torch is imported: in the template too)."""
    env = launcher_env(CONSOLE_PROBE="lost_peer")
    context = probe_context(tmp_path)
    code, stderr = run_new_interpreter(context, env) if start == "new-interpreter" else run_forked(context, env, capfd)
    assert code == 2, stderr
    assert "probe: lost the peer:" in stderr, stderr
    assert not [marker for marker in CPP_STACK_TRACE if marker in stderr], stderr


WRITER = """
import os, sys
import structlog
from actors.runtime.logs import configure_logging
configure_logging(role="writer", actor_id=f"writer-{os.getpid()}", node=0, log_dir=None)
log = structlog.get_logger()
for number in range(int(sys.argv[1])):
    log.warning("line", number=number, payload=f"<{os.getpid()}:{number}:" + "x" * 1500 + ">")
"""


@pytest.mark.integration
def test_console_lines_of_two_actors_sharing_one_pipe_never_splice(tmp_path: Path) -> None:
    """Unbuffered, as the launcher starts actors: each record must reach the pipe in one write, newline included."""
    lines_each = 1500
    read_end, write_end = os.pipe()
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(lines_each)], cwd=REPO, env=launcher_env(),
                                stdout=subprocess.DEVNULL, stderr=write_end) for _ in range(2)]
    os.close(write_end)
    with os.fdopen(read_end, encoding="utf-8") as pipe:
        lines = pipe.read().splitlines()
    assert [writer.wait(timeout=120) for writer in writers] == [0, 0]
    whole = re.compile(r"\[warning\s*\] line .*payload=<(\d+):(\d+):x{1500}>")
    spliced = [line[:120] for line in lines if len(whole.findall(line)) != 1]
    assert spliced == []
    seen = {(int(pid), int(number)) for pid, number in (whole.search(line).groups() for line in lines)}
    assert seen == {(writer.pid, number) for writer in writers for number in range(lines_each)}


WARNER = """
import os, sys, sysconfig, warnings
from pathlib import Path
from actors.runtime.logs import configure_logging, route_python_warnings
configure_logging(role="warner", actor_id="warner", node=0, log_dir=Path(sys.argv[1]), console_level="warning")
route_python_warnings()
library = os.path.join(sysconfig.get_paths()["purelib"], "somelib", "kernels.py")
warnings.warn_explicit("Apex is not installed, falling back", UserWarning, library, 21)
warnings.warn("my reward plugin is deprecated", UserWarning)
"""


@pytest.mark.integration
def test_a_librarys_python_warning_goes_to_the_log_file_and_a_plugins_to_the_console_too(tmp_path: Path) -> None:
    """megatron's start-up warnings (TE and apex missing, deprecated torch calls) filled a megatron run's terminal
    with some twenty raw lines; they belong in the actor's log, while a warning from a user's code stays in view."""
    completed = subprocess.run([sys.executable, "-c", WARNER, str(tmp_path)], cwd=REPO, env=launcher_env(),
                               capture_output=True, text=True, timeout=120, check=False)
    assert completed.returncode == 0, completed.stderr
    assert "Apex is not installed" not in completed.stderr
    assert re.search(r"\[warning\s*\] python warning .*message='my reward plugin is deprecated'", completed.stderr)
    records = (tmp_path / "warner.jsonl").read_text(encoding="utf-8").splitlines()
    library = [line for line in records if "Apex is not installed" in line]
    assert len(library) == 1 and '"level": "info"' in library[0] and "somelib" in library[0]
    assert any("my reward plugin is deprecated" in line and '"level": "warning"' in line for line in records)
