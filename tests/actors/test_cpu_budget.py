"""The CPU budget of a CPU-only node: which cores and torch threads each actor gets, and that pinning is real."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import launcher
from actors.launch import node_roles
from actors.runtime.cpu_budget import CpuShare, plan_cpu_budget
from tests.support.launch_inputs import minimal_inputs

ROLES = {"controller": "controller", "buffer": "buffer", "learner": "learner", "rollout-0-0": "rollout",
         "rollout-0-1": "rollout", "reward-0-0": "reward"}


@pytest.mark.unit
def test_a_fully_async_learner_gets_cores_of_its_own_and_the_others_share_the_rest() -> None:
    plan = plan_cpu_budget(cores=[0, 1], roles=ROLES, gpus=0, learner_ranks=1, synchronous=False)
    assert plan["learner"] == CpuShare(cores=(0, 1), torch_threads=1)
    assert {plan[actor] for actor in ROLES if actor != "learner"} == {CpuShare(cores=(0,))}
    wide = plan_cpu_budget(cores=range(8), roles=ROLES, gpus=0, learner_ranks=1, synchronous=False)
    assert wide["learner"].torch_threads == 4 and wide["rollout-0-0"].cores == (0, 1, 2, 3)


@pytest.mark.unit
def test_a_synchronous_learner_trains_on_every_cores_threads_and_nothing_is_pinned() -> None:
    plan = plan_cpu_budget(cores=[0, 1, 2, 3], roles=ROLES, gpus=0, learner_ranks=1, synchronous=True)
    assert plan == {"learner": CpuShare(cores=None, torch_threads=4)}


@pytest.mark.unit
@pytest.mark.parametrize("case", [{"gpus": 1}, {"cores": [0]}, {"learner_ranks": 2},
                                  {"roles": {"rollout-1-0": "rollout"}}])
def test_no_budget_where_the_os_should_place_the_actors(case: dict) -> None:
    arguments = {"cores": [0, 1], "roles": ROLES, "gpus": 0, "learner_ranks": 1, "synchronous": False, **case}
    assert plan_cpu_budget(**arguments) == {}


def _contexts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *flags: str):
    monkeypatch.setattr(node_roles, "visible_gpus", lambda: 0)
    monkeypatch.setattr(launcher, "usable_cores", lambda: (0, 1))
    contexts, _args, _run_dir = launcher.prepare(["--head", "--run-dir", str(tmp_path / "run"),
                                                  *minimal_inputs(tmp_path), "--rollout-workers", "2", *flags])
    return {c.actor_id: (c.cpu_cores, c.torch_threads) for c in contexts}


@pytest.mark.unit
def test_the_launcher_writes_each_actors_share_into_its_context(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    shares = _contexts(tmp_path, monkeypatch)
    assert shares["learner"] == ((0, 1), 1) and shares["rollout-0-1"] == ((0,), None)
    assert _contexts(tmp_path, monkeypatch, "--max-staleness", "0")["learner"] == (None, 2)
    assert set(_contexts(tmp_path, monkeypatch, "--cpu-budget", "off").values()) == {(None, None)}


@pytest.mark.unit
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable cores to pin to one of them")
def test_pinning_reaches_every_thread_already_running() -> None:
    """An engine's decode thread starts before the actor pins itself; it must be pinned too."""
    code = (
        "import os, threading\n"
        "from actors.runtime.cpu_budget import pin_process\n"
        "seen = {}\n"
        "started, pinned = threading.Event(), threading.Event()\n"
        "def worker():\n"
        "    started.set(); pinned.wait(30); seen['mask'] = os.sched_getaffinity(0)\n"
        "thread = threading.Thread(target=worker); thread.start(); started.wait(30)\n"
        f"pin_process([{min(os.sched_getaffinity(0))}])\n"
        "pinned.set(); thread.join(); print(sorted(seen['mask']), sorted(os.sched_getaffinity(0)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout.split("]")
    core = min(os.sched_getaffinity(0))
    assert out[0].strip() == f"[{core}" and out[1].strip() == f"[{core}"
