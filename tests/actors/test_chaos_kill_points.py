"""Kill points (actors/runtime/chaos.py): a real process really dies by SIGKILL at the Nth phase, once per run."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from actors.runtime import chaos
from actors.runtime.chaos import KillPlanError, KillPoint, parse_plan
from tools.repo_env import with_repo_on_path

REPO = Path(__file__).resolve().parents[2]

# A stand-in actor process: arms itself as `actor_id` of `role`, then reaches `phase` five times, saying so.
REACHER = """
import sys
from pathlib import Path
from actors.runtime import chaos
actor_id, role, run_dir, phase = sys.argv[1:5]
chaos.arm(actor_id, role, Path(run_dir))
for n in range(1, 6):
    chaos.reached(phase)
    print(n, flush=True)
"""

# A stand-in worker: the work of each of five rounds awaits (a real generation) or finishes without waiting.
DURING = """
import asyncio, sys
from pathlib import Path
from actors.runtime import chaos
chaos.arm("rollout-0-0", "rollout", Path(sys.argv[1]))
waits = sys.argv[2] == "waits"

async def generate(n):
    if waits:
        await asyncio.sleep(0.01)
    return n

async def main():
    for n in range(1, 6):
        print(await chaos.during("generate.mid", generate(n)), flush=True)

asyncio.run(main())
"""


def run_script(script: str, *args: str, plan: str) -> subprocess.CompletedProcess[str]:
    env = with_repo_on_path(**{chaos.KILL_ENV: plan})
    return subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                          timeout=60, cwd=REPO)


@pytest.mark.unit
def test_a_plan_reads_targets_phases_counts_and_stalls() -> None:
    assert parse_plan("learner@weight_push.mid#2, rollout-*@generate.mid, rollout-0-1@weight_load.start#4=stall:2.5"
                      ) == [KillPoint("learner", "weight_push.mid", 2), KillPoint("rollout-*", "generate.mid", 1),
                            KillPoint("rollout-0-1", "weight_load.start", 4, stall_s=2.5)]
    assert KillPoint("rollout-*", "generate.mid").matches("rollout-0-1", "rollout")
    assert KillPoint("reward", "score.mid").matches("reward-0-0", "reward")
    assert not KillPoint("learner", "checkpoint.mid").matches("buffer", "buffer")


@pytest.mark.unit
@pytest.mark.parametrize(("text", "named"), [
    ("learner@weight_push.middle", "unknown phase 'weight_push.middle'"),
    ("learner", "expected TARGET@PHASE"),
    ("@checkpoint.mid", "expected TARGET@PHASE"),
    ("buffer@batch_serve.mid#0", "N must be a whole number >= 1"),
    ("buffer@batch_serve.mid#x", "N must be a whole number >= 1"),
    ("buffer@batch_serve.mid=pause:3", "the action must be stall:SECONDS"),
    ("buffer@batch_serve.mid=stall:0", "the action must be stall:SECONDS"),
])
def test_a_bad_plan_is_refused_naming_the_item(text: str, named: str) -> None:
    with pytest.raises(KillPlanError, match=named) as caught:
        parse_plan(text)
    assert chaos.KILL_ENV in str(caught.value)


@pytest.mark.integration
def test_the_process_is_killed_at_the_nth_phase_and_its_restart_is_not(tmp_path: Path) -> None:
    first = run_script(REACHER, "learner", "learner", str(tmp_path), "checkpoint.mid",
                       plan="learner@checkpoint.mid#3")
    assert first.returncode == -signal.SIGKILL, first.stderr
    assert first.stdout.split() == ["1", "2"]
    [mark] = chaos.fired(tmp_path)
    assert mark["actor"] == "learner" and mark["n"] == 3 and mark["phase"] == "checkpoint.mid"

    again = run_script(REACHER, "learner", "learner", str(tmp_path), "checkpoint.mid",
                       plan="learner@checkpoint.mid#3")
    assert again.returncode == 0, "the restarted process was killed again: a crash loop"
    assert again.stdout.split() == ["1", "2", "3", "4", "5"]


@pytest.mark.integration
def test_a_stall_point_freezes_the_process_once_and_lets_it_go_on(tmp_path: Path) -> None:
    started = time.monotonic()
    stalled = run_script(REACHER, "rollout-0-1", "rollout", str(tmp_path), "weight_load.start",
                         plan="rollout-0-1@weight_load.start#2=stall:1.5")
    assert stalled.returncode == 0, stalled.stderr
    assert stalled.stdout.split() == ["1", "2", "3", "4", "5"]
    assert time.monotonic() - started >= 1.5
    [mark] = chaos.fired(tmp_path)
    assert mark["point"] == "rollout-0-1@weight_load.start#2=stall:1.5" and mark["n"] == 2


@pytest.mark.integration
def test_other_actors_and_other_phases_are_left_alone(tmp_path: Path) -> None:
    other_actor = run_script(REACHER, "buffer", "buffer", str(tmp_path), "checkpoint.mid",
                             plan="learner@checkpoint.mid")
    other_phase = run_script(REACHER, "learner", "learner", str(tmp_path), "weight_push.mid",
                             plan="learner@checkpoint.mid")
    assert other_actor.returncode == other_phase.returncode == 0
    assert chaos.fired(tmp_path) == []


@pytest.mark.integration
def test_a_bad_plan_fails_the_actor_as_a_bad_configuration(tmp_path: Path) -> None:
    """Through the real actor entry point: exit code 2 with the reason, so the launcher does not restart it."""
    context = {"actor_id": "learner", "role": "learner", "actor_class": "actors.learner.actor:Learner",
               "node_rank": 0, "head_address": "tcp://127.0.0.1:9", "run_dir": str(tmp_path)}
    path = tmp_path / "learner.json"
    path.write_text(json.dumps(context))
    env = with_repo_on_path(**{chaos.KILL_ENV: "learner@weight_push.middle"})
    done = subprocess.run([sys.executable, "-m", "actors.runtime.main", str(path)], env=env, capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert done.returncode == 2, done.stderr[-2000:]
    [report] = (tmp_path / "actors").glob("learner.*")  # the reason left for the launcher (actors.runtime.exits)
    assert "unknown phase 'weight_push.middle'" in report.read_text()


@pytest.mark.integration
def test_during_kills_while_the_work_is_under_way(tmp_path: Path) -> None:
    killed = run_script(DURING, str(tmp_path), "waits", plan="rollout-0-0@generate.mid#2")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert killed.stdout.split() == ["1"]


@pytest.mark.integration
def test_during_does_not_count_work_that_never_waited(tmp_path: Path) -> None:
    """Work that finished in its first step was never "mid": the phase is not reached."""
    done = run_script(DURING, str(tmp_path), "instant", plan="rollout-0-0@generate.mid#1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "2", "3", "4", "5"]


@pytest.mark.unit
def test_unarmed_kill_points_cost_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(chaos.KILL_ENV, raising=False)
    chaos.arm("learner", "learner", tmp_path)
    chaos.reached("weight_push.mid")

    async def work() -> int:
        return 1

    coroutine = work()
    assert chaos.during("generate.mid", coroutine) is coroutine
    coroutine.close()
