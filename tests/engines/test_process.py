"""`engines.process.exit_now`: a process that is done runs its exit handlers and ends, without tearing its modules
down (~0.7 s for torch and transformers, which a follower rank's rank 0 and every launcher waited for)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# A module-level object is finalized when the interpreter tears its modules down, and only then.
SCRIPT = """
import atexit, sys
from engines.process import exit_now

class Finalized:
    def __del__(self):
        print("modules torn down", flush=True)

KEPT = Finalized()
atexit.register(lambda: print("exit handlers ran", flush=True))
print("buffered, not flushed", end="")
{end}
"""


def run(end: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", SCRIPT.format(end=end)], cwd=REPO, capture_output=True, text=True,
                          timeout=60, check=False)


@pytest.mark.integration
def test_exit_now_runs_the_exit_handlers_flushes_and_keeps_the_code_but_skips_the_modules_teardown() -> None:
    ended = run("exit_now(3)")
    assert ended.returncode == 3, ended.stderr
    assert "buffered, not flushed" in ended.stdout and "exit handlers ran" in ended.stdout
    assert "modules torn down" not in ended.stdout
    ordinary = run("sys.exit(3)")  # what the check tells apart: an ordinary exit does tear them down
    assert ordinary.returncode == 3 and "modules torn down" in ordinary.stdout, ordinary.stdout + ordinary.stderr
