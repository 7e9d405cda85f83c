"""launcher.py with real processes and sockets: restarts, death announcements, shutdown, errors."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from actors.launch.supervisor import Supervisor
from actors.runtime.context import ActorContext, ActorSettings
from actors.runtime.roles import BUILTIN_ROLES
from bus.address import free_port, ipc_sockets_dir
from tests.support.processes import alive

REPO = Path(__file__).resolve().parents[2]
SUPPORT = REPO / "tests" / "support"
FAST = ["--heartbeat-interval", "0.2", "--restart-backoff", "0.2", "--no-progress", "--log-level", "debug"]
# Actors forked from the template (the default) wait until it imported torch and transformers, since a custom role
# may hold a model: seconds that only the tests about how forked actors are named, stopped and killed need. The
# others run their custom actors as new interpreters; the launcher's policy they test is the same either way, and
# tests/actors/test_zygote.py checks that a forked actor's exit and signals reach the launcher.
NO_TEMPLATE = "--no-fork-actors"


def launcher_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SUPPORT), str(REPO), env.get("PYTHONPATH", "")])
    return env


def start(run_dir: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(REPO / "launcher.py"), "--head", "--run-dir", str(run_dir), *FAST,
                             *args], cwd=REPO, env=launcher_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def run_to_end(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPO / "launcher.py"), *args], cwd=REPO, env=launcher_env(),
                          capture_output=True, text=True, timeout=timeout)


def wait_until(condition: Callable[[], object], timeout: float, what: str) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def actor_pids(run_dir: Path) -> dict[str, list[int]]:
    pids: dict[str, list[int]] = {}
    for record in jsonl(run_dir / "logs" / "launcher-0.jsonl"):
        if record.get("event") == "actor process started":
            pids.setdefault(record["actor"], []).append(record["pid"])
    return pids


def stop(process: subprocess.Popen[str]) -> str:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        output, _ = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()  # its actors get SIGTERM through PDEATHSIG
        output, _ = process.communicate()
        raise AssertionError(f"launcher ignored SIGTERM:\n{output[-3000:]}") from None
    return output


def both_producers_delivered(run_dir: Path) -> bool:
    """The consumer counted at least 5 samples from each of the two producers."""
    for path in run_dir.glob("consumed-*.json"):
        try:
            counts = json.loads(path.read_text())
        except json.JSONDecodeError:
            continue
        if len(counts) == 2 and min(counts.values()) >= 5:
            return True
    return False


@pytest.mark.system
def test_a_killed_actor_is_restarted_and_announced_a_stream_flows_and_sigterm_leaves_no_process_or_socket(
        tmp_path: Path) -> None:
    """One run of forked actors (the template's start-up is paid once) for three claims: a killed actor is
    restarted under its name and its death and return are announced; samples stream between processes over ipc;
    SIGTERM then leaves no process and no socket behind."""
    run_dir = tmp_path / "run"
    process = start(run_dir, "--roles", "controller", "--transport", "ipc",
                    "--custom-actor", "rec=runtime_actors:RosterRecorder",
                    "--custom-actor", "victim=runtime_actors:RosterRecorder",
                    "--custom-actor", "producer=runtime_actors:Producer", "--producer-workers", "2",
                    "--custom-actor", "consumer=runtime_actors:Consumer")
    events = run_dir / "roster_events.jsonl"
    try:
        wait_until(lambda: both_producers_delivered(run_dir), 60, "samples from both producers at the consumer")
        members = run_dir / "roster_members.json"
        wait_until(lambda: members.exists() and "victim-0-0" in members.read_text(), 60, "victim to join")
        victim_pid = actor_pids(run_dir)["victim-0-0"][0]
        # what ps -f / pgrep -f and top show for it: its id, not the template it was forked from
        assert Path(f"/proc/{victim_pid}/comm").read_text().strip() == "victim-0-0"
        title = Path(f"/proc/{victim_pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        assert title == f"slipstream victim-0-0 node 0 run {run_dir}"
        # RUN_DIR/pids.json names this run's processes, and the title recipe of the README matches exactly one
        listed = json.loads((run_dir / "pids.json").read_text())
        assert listed["launcher"] == process.pid and listed["actors"]["victim-0-0"] == victim_pid
        assert set(listed["actors"]) == {"controller", "rec-0-0", "victim-0-0", "producer-0-0", "producer-0-1",
                                         "consumer-0-0"}
        matched = subprocess.run(["pgrep", "-fx", f"slipstream victim-0-0 node 0 run {run_dir}"],
                                 capture_output=True, text=True, check=True).stdout.split()
        assert matched == [str(victim_pid)]
        os.kill(victim_pid, signal.SIGKILL)
        wait_until(lambda: len(actor_pids(run_dir)["victim-0-0"]) == 2, 30, "the launcher to restart the victim")
        restarted = actor_pids(run_dir)["victim-0-0"][1]
        wait_until(lambda: json.loads((run_dir / "pids.json").read_text())["actors"].get("victim-0-0") == restarted,
                   30, "pids.json to name the restarted victim")
        kinds = wait_until(
            lambda: [e["kind"] for e in jsonl(events) if e["actor_id"] == "victim-0-0"
                     and e["kind"] in ("died", "returned")][:2] == ["died", "returned"], 30,
            "death and return announcements")
        assert kinds
    finally:
        output = stop(process)
    assert process.returncode == 128 + signal.SIGTERM, output
    assert not (run_dir / "pids.json").exists()  # its pids may be other processes' once the run is over
    started = actor_pids(run_dir)
    assert {name: len(pids) for name, pids in started.items()} == {
        "controller": 1, "rec-0-0": 1, "victim-0-0": 2, "producer-0-0": 1, "producer-0-1": 1, "consumer-0-0": 1}
    assert not [pid for pids in started.values() for pid in pids if alive(pid)]
    assert not list(ipc_sockets_dir(run_dir).glob("*.sock"))


def exit_after_sigterm(process: subprocess.Popen[str]) -> tuple[str, float]:
    """SIGTERM to the launcher; its output, and the seconds it took to exit."""
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=60)
    return output, time.monotonic() - signalled


@pytest.mark.system
def test_a_second_signal_kills_every_actor_at_once(tmp_path: Path) -> None:
    """The first SIGTERM lets actors drain (a learner gets minutes, for its step and checkpoint); a second one is
    the user saying "now", and must not wait for that."""
    run_dir = tmp_path / "run"
    process = start(run_dir, "--roles", "controller", "--custom-actor", "slow=runtime_actors:SlowToStop")
    try:
        wait_until(lambda: "slow-0-0" in actor_pids(run_dir), 60, "the slow actor to start")
        wait_until(lambda: any(r.get("event") == "actor started" for r in jsonl(run_dir / "logs" / "slow-0-0.jsonl")),
                   60, "the slow actor to be running")
        process.send_signal(signal.SIGTERM)
        launcher_log = run_dir / "logs" / "launcher-0.jsonl"
        wait_until(lambda: any(r.get("event") == "stopping actors" for r in jsonl(launcher_log)), 60,
                   "the launcher to take the first signal")
        output, took = exit_after_sigterm(process)
    finally:
        if process.poll() is None:
            process.kill()
    assert took < 8.0, f"the launcher took {took:.1f} s after the second signal:\n{output[-3000:]}"
    assert "second signal: killing every actor now" in output
    assert not [pid for started in actor_pids(run_dir).values() for pid in started if alive(pid)]


@pytest.mark.system
def test_an_actor_still_starting_stops_at_the_first_signal(tmp_path: Path) -> None:
    """SIGTERM during a long start-up (a model loading, an SGLang server coming up) gives the start up: the actor
    exits at once instead of after its start-up, or at the SIGKILL that follows the launcher's grace."""
    run_dir = tmp_path / "run"
    process = start(run_dir, NO_TEMPLATE, "--roles", "controller", "--custom-actor", "slow=runtime_actors:SlowToStart")
    try:
        wait_until(lambda: (run_dir / "slow-0-0.starting").exists(), 60, "the slow actor to be starting")
        output, took = exit_after_sigterm(process)
    finally:
        if process.poll() is None:
            process.kill()
    assert took < 8.0, f"the launcher took {took:.1f} s after the signal:\n{output[-3000:]}"
    assert "ignored SIGTERM" not in output
    events = [record.get("event") for record in jsonl(run_dir / "logs" / "slow-0-0.jsonl")]
    assert "stopped while starting" in events and "actor started" not in events
    assert not [pid for started in actor_pids(run_dir).values() for pid in started if alive(pid)]


def controller_and(run_dir: Path, actor_id: str, role: str, actor_class: str) -> list[ActorContext]:
    """The contexts of a head with a controller and one more actor, for a Supervisor run in this process."""
    head = f"tcp://127.0.0.1:{free_port()}"
    quiet = ActorSettings(console_log_level="error")
    return [ActorContext(actor_id=name, role=kind, actor_class=path, node_rank=0, head_address=head, run_dir=run_dir,
                         heartbeat_interval=0.2, settings=quiet)
            for name, kind, path in (("controller", "controller", BUILTIN_ROLES["controller"]),
                                     (actor_id, role, actor_class))]


@pytest.mark.system
@pytest.mark.timeout(120)
async def test_a_stopping_learner_gets_the_time_its_step_and_checkpoint_take(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every other actor is killed 15 s after SIGTERM (1 s here); a learner killed then lost what it trained since
    its last checkpoint (the one it writes as it stops never landed)."""
    monkeypatch.setenv("SLOW_TO_STOP_S", "2")
    contexts = controller_and(tmp_path, "learner", "learner", "tests.support.runtime_actors:SlowToStop")
    supervisor = Supervisor(contexts, run_dir=tmp_path, stop_grace_s=1.0)
    running = asyncio.create_task(supervisor.run())
    await asyncio.to_thread(wait_until, lambda: any(
        r.get("event") == "actor started" for r in jsonl(tmp_path / "logs" / "learner.jsonl")), 60, "the learner")
    supervisor.request_stop("test", signum=signal.SIGTERM)
    assert await asyncio.wait_for(running, 90) == 128 + signal.SIGTERM
    assert (tmp_path / "learner.drained").exists(), "the learner was killed before it finished stopping"


@pytest.mark.system
@pytest.mark.timeout(120)
async def test_a_finished_run_stops_an_actor_that_never_joined_without_waiting_out_the_grace(tmp_path: Path) -> None:
    """The grace after a run finishes is for actors that heard the controller's stop and are leaving on their own;
    one still starting (a second rollout worker loading its model when a short run ends) never heard it, and waited
    the whole grace (15 s) before its SIGTERM."""
    contexts = controller_and(tmp_path, "slow-0-0", "slow", "tests.support.runtime_actors:SlowToStart")
    grace_s = 600.0
    supervisor = Supervisor(contexts, run_dir=tmp_path, stop_grace_s=grace_s)
    running = asyncio.create_task(supervisor.run())
    await asyncio.to_thread(wait_until, (tmp_path / "slow-0-0.starting").exists, 60, "the slow actor to be starting")
    supervisor.request_stop("the controller finished the run", grace_s=grace_s)  # as when the controller exits 0
    assert await asyncio.wait_for(running, 90) == 0  # not the grace: at once, by SIGTERM
    events = [record.get("event") for record in jsonl(tmp_path / "logs" / "slow-0-0.jsonl")]
    assert "stopped while starting" in events and "registered" not in events


@pytest.mark.system
def test_actor_that_keeps_crashing_fails_the_run(tmp_path: Path) -> None:
    result = run_to_end("--head", "--run-dir", str(tmp_path / "run"), *FAST, NO_TEMPLATE, "--roles", "controller",
                        "--custom-actor", "boom=runtime_actors:Crasher", "--max-restarts", "2", timeout=120)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "boom-0-0 crashed 3 times" in result.stderr


def launcher_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """`launcher.py ARGS` as its `__main__` runs it (`sys.exit(main())`), in this process: its exit code, stdout
    and stderr."""
    import launcher

    try:
        code = launcher.main(list(args))
    except SystemExit as exited:
        code = exited.code if isinstance(exited.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.integration
def test_launcher_errors_name_what_is_wrong(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Each refusal comes from the launcher's `main` before any actor starts, so it is called here rather than
    in a new interpreter per case (`test_bad_settings_are_all_reported_before_any_actor_starts` runs one)."""
    # where `runtime_actors` lives; after this tree, as in launcher_env() (tests/support/policies.py would shadow
    # the `policies` package)
    monkeypatch.setattr(sys, "path", [*sys.path, str(SUPPORT)])
    code, _, err = launcher_main(capsys, "--head", "--no-such-flag")
    assert code == 2 and "unrecognized arguments: --no-such-flag" in err

    code, _, err = launcher_main(capsys, "--head", "--run-dir", str(tmp_path / "a"), "--roles", "controller",
                                 "--custom-actor", "x=runtime_actors:NoSuchClass")
    assert code == 2
    assert "'runtime_actors' has no attribute 'NoSuchClass'" in err

    code, _, err = launcher_main(capsys, "--head", "--run-dir", str(tmp_path / "b"), "--custom-actor",
                                 "x=nowhere.mod:A")
    assert code == 2 and "cannot import module 'nowhere.mod'" in err

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, _, err = launcher_main(capsys, "--head", "--head-address", f"tcp://127.0.0.1:{port}", "--run-dir",
                                     str(tmp_path / "c"))
    assert code == 2 and "cannot bind" in err and str(port) in err

    code, _, err = launcher_main(capsys, "--head-address", f"tcp://127.0.0.1:{port}", "--connect-timeout", "1",
                                 "--run-dir", str(tmp_path / "d"))
    assert code == 2 and "unreachable after 1s" in err

    code, out, _ = launcher_main(capsys, "--help")
    assert code == 0
    for flag in ("--rollout-workers", "--max-staleness", "--eps-clip-high", "--custom-actor", "--head-address"):
        assert flag in out
    assert "--num-layers" not in out and "--num-layers" in launcher_main(capsys, "--help-all")[1]


@pytest.mark.integration
def test_bad_settings_are_all_reported_before_any_actor_starts(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("", encoding="utf-8")
    no_model = tmp_path / "no-model"
    run_dir = tmp_path / "run"
    started = time.monotonic()
    result = run_to_end("--head", "--run-dir", str(run_dir), "--prompt-data", str(empty), "--hf-checkpoint",
                        str(no_model), "--custom-rm-path", "runtime_actors:no_such_reward", "--max-staleness", "-1")
    elapsed = time.monotonic() - started
    assert result.returncode == 2, result.stderr[-3000:]
    assert "--max-staleness -1: must be >= 0" in result.stderr  # a bad value, in the same list as the files
    assert f"--prompt-data {empty}: no records (the file is empty)" in result.stderr
    assert f"--hf-checkpoint {no_model}: not found: no such directory" in result.stderr
    assert "--custom-rm-path 'runtime_actors:no_such_reward': 'runtime_actors' has no attribute" in result.stderr
    assert "Traceback" not in result.stderr and "restarting" not in result.stderr
    assert not run_dir.exists(), "nothing starts, not even the run directory"
    assert elapsed < 15, f"the launcher took {elapsed:.1f}s to refuse the run"


@pytest.mark.system
@pytest.mark.parametrize("fork", ["--fork-actors", "--no-fork-actors"])
def test_actor_with_a_bad_setting_fails_the_run_at_once_with_its_reason(tmp_path: Path, fork: str) -> None:
    run_dir = tmp_path / "run"
    result = run_to_end("--head", "--run-dir", str(run_dir), *FAST, fork, "--roles", "controller",
                        "--custom-actor", "bad=runtime_actors:MisconfiguredWhenBuilt", timeout=120)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "bad-0-0: bad configuration: --custom-threshold 7: must be below 1" in result.stderr
    assert len(actor_pids(run_dir)["bad-0-0"]) == 1, "an actor with a bad setting is not restarted"
    assert "restarting" not in result.stderr


@pytest.mark.system
def test_actor_that_finds_a_bad_setting_while_starting_is_not_restarted(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_to_end("--head", "--run-dir", str(run_dir), *FAST, NO_TEMPLATE, "--max-restarts", "1",
                        "--roles", "controller", "--custom-actor", "bad=runtime_actors:MisconfiguredWhenStarting",
                        timeout=120)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "bad-0-0: bad configuration: --custom-threshold 7: must be below 1 (found while" in result.stderr
    assert len(actor_pids(run_dir)["bad-0-0"]) == 1
    assert "restarting" not in result.stderr


@pytest.mark.system
def test_a_worker_node_takes_the_run_settings_from_the_head(tmp_path: Path) -> None:
    """The README's worker command: no --hf-checkpoint on the worker; its own flags override the head's."""
    address = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    head = start(tmp_path / "head", NO_TEMPLATE, "--head-address", address, "--roles", "controller",
                 "--hf-checkpoint", "/models/the-heads", "--rollout-batch-size", "3",
                 "--sglang-url", "http://the-head:30000")
    worker_dir = tmp_path / "worker"
    worker = subprocess.Popen(
        [sys.executable, str(REPO / "launcher.py"), "--head-address", address, "--node-rank", "1",
         "--run-dir", str(worker_dir), *FAST, NO_TEMPLATE, "--roles", "rec",
         "--custom-actor", "rec=runtime_actors:SettingsRecorder", "--rollout-batch-size", "5"],
        cwd=REPO, env=launcher_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    recorded = worker_dir / "settings-rec-1-0.json"
    try:
        wait_until(lambda: recorded.exists() or worker.poll() is not None, 60, "the worker's actor to start")
    finally:
        output = stop(worker)
        stop(head)
    assert recorded.exists(), output[-3000:]
    settings = json.loads(recorded.read_text(encoding="utf-8"))
    assert settings["model"]["hf_checkpoint"] == "/models/the-heads"
    assert settings["rollout"]["rollout_batch_size"] == 5, "a flag given on the worker overrides the head's"
    assert settings["engine"]["sglang_url"] == [], "the head's own SGLang servers are not the worker's"
