"""A test's changes to the process environment end with it (`tests/conftest.py`): the processes later tests of the
same worker start must not inherit them. An in-process two-node learner test once left GLOO_SOCKET_IFNAME=lo
behind, and the two-node runs after it on that worker formed their worlds on loopback and never trained."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LEAK_THEN_LOOK = '''
import os

def test_1_changes_the_environment():
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ.pop("SLIPSTREAM_ISOLATION_PROBE")

def test_2_finds_it_as_it_was():
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    assert os.environ["SLIPSTREAM_ISOLATION_PROBE"] == "kept"
'''


@pytest.mark.integration
def test_a_tests_environment_changes_do_not_reach_the_next_test(tmp_path: Path) -> None:
    (tmp_path / "test_probe.py").write_text(LEAK_THEN_LOOK, encoding="utf-8")
    env = {key: value for key, value in os.environ.items() if key != "GLOO_SOCKET_IFNAME"}
    env["SLIPSTREAM_ISOLATION_PROBE"] = "kept"
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-n", "0", "-q", "-p",
                           "no:cacheprovider", "--rootdir", str(tmp_path), "-c", "/dev/null", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "2 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]
