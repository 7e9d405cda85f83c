"""One chaos scenario: a real small fully-async run through launcher.py, its fault, and the verdict.

The run is the system tests' small run (the tiny model, 2 rollout workers, 1 reward worker, fast heartbeats and
restarts, a checkpoint every 4 steps, a compacting buffer log). Every wait here has a deadline; a run that overstays
its own is stopped (SIGCONT to whatever this tool stopped, SIGTERM to the launcher, SIGKILL after 30 s) and fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from actors.runtime import chaos
from actors.runtime.metrics import read_metrics
from bus import faults
from tools.audit_run import AuditReport, audit
from tools.chaos.scenarios import FAIL_MARGIN_S, KILLABLE, Scenario
from tools.run_watch import LAUNCHER_LOG, started_actor_pids

REPO = Path(__file__).resolve().parents[2]
HEARTBEAT_INTERVAL_S = 0.25  # a member silent for 5 intervals is declared dead
STOP_GRACE_S = 30.0  # after SIGTERM to a launcher that overstayed, before SIGKILL
POLL_S = 0.2
RUN_MARK_ENV = "SLIPSTREAM_CHAOS_RUN"


@dataclass
class Outcome:
    """One row of the chaos table."""

    scenario: str
    fault: str
    expected: str
    outcome: str = ""  # completed / failed / exit N / timed out / skipped
    verdict: str = "FAIL"  # PASS / FAIL / SKIP
    reason: str = ""
    wall_s: float = 0.0
    steps: int = 0
    num_rollout: int = 0
    accepted_groups: int = 0
    trained_groups: int = 0
    pending_groups: int = 0
    retrained_batches: int = 0
    injected: str = ""  # what the fault did, in counts
    exit_code: int | None = None
    run_dir: str = ""
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def launch_command(run_dir: Path, model: Path, data: Path, scenario: Scenario) -> list[str]:
    command = [sys.executable, str(REPO / "launcher.py"), "--head", "--run-dir", str(run_dir),
               "--hf-checkpoint", str(model), "--prompt-data", str(data), "--num-rollout", str(scenario.num_rollout),
               "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "4",
               "--max-staleness", "2", "--save-interval", "4", "--lease-timeout", "20", "--lr", "1e-4",
               "--rollout-workers", "2", "--reward-workers", "1", "--heartbeat-interval", str(HEARTBEAT_INTERVAL_S),
               "--restart-backoff", "0.2", "--weight-transfer-timeout", "5", "--no-progress",
               "--no-use-tensorboard", "--no-plots", "--buffer-log-compact-mb", "0.05"]
    if scenario.hang_timeout is not None:
        command += ["--hang-timeout", f"{scenario.hang_timeout:g}"]
    return [*command, *scenario.extra]


def launcher_accepts(flag: str) -> bool:
    """Whether this checkout's launcher has `flag` (the hang detector's --hang-timeout lands separately)."""
    from launcher import build_parser

    return flag in build_parser()._option_string_actions


def run_scenario(scenario: Scenario, *, model: Path, data: Path, run_dir: Path) -> Outcome:
    """Run `scenario` in `run_dir` (created; must not exist) and judge it."""
    outcome = Outcome(scenario.name, scenario.fault, scenario.expect, num_rollout=scenario.num_rollout,
                      run_dir=str(run_dir))
    if scenario.hang_timeout is not None and not launcher_accepts("--hang-timeout"):
        outcome.outcome, outcome.verdict = "skipped", "SKIP"
        outcome.reason = "launcher.py has no --hang-timeout yet (the hang detector has not landed)"
        return outcome
    run_dir.mkdir(parents=True)
    console_path = run_dir / "console.txt"
    started = time.monotonic()
    stopped: list[int] = []
    injected: dict[str, Any] = {}
    with open(console_path, "w", encoding="utf-8") as console:
        command, env = launch_command(run_dir, model, data, scenario), _env(scenario, run_dir)
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=console, stderr=subprocess.STDOUT, text=True)
        try:
            injected = _inject(scenario, process, run_dir, started, stopped)
            deadline = _deadline(scenario, started, injected)
            outcome.exit_code = _wait(process, deadline)
        finally:
            _cleanup(process, run_dir, stopped)
    outcome.wall_s = time.monotonic() - started
    _judge(outcome, scenario, run_dir, console_path.read_text(encoding="utf-8", errors="replace"), injected)
    return outcome


# ------------------------------------------------------------------------------------------- injecting
def _env(scenario: Scenario, run_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (chaos.KILL_ENV, faults.PLAN_ENV, faults.REPORT_ENV)}
    env[RUN_MARK_ENV] = str(run_dir)  # every actor inherits it: how the cleanup knows a process is this run's
    if scenario.kill_plan:
        chaos.parse_plan(scenario.kill_plan)  # a typo fails here, not as a crashing actor
        env[chaos.KILL_ENV] = scenario.kill_plan
    if scenario.bus_plan:
        faults.FaultPlan.parse(scenario.bus_plan)
        env[faults.PLAN_ENV] = scenario.bus_plan
        env[faults.REPORT_ENV] = str(run_dir / "bus-faults")
    return env


def _inject(scenario: Scenario, process: subprocess.Popen[str], run_dir: Path, started: float,
            stopped: list[int]) -> dict[str, Any]:
    """Do the tool's part of the fault (kill_point and bus need none); what was done, and when."""
    if scenario.how not in ("kill", "stop", "stop_left"):
        return {}
    rng = random.Random(scenario.seed)
    target = rng.choice(KILLABLE) if scenario.target == "random" else scenario.target
    assert target is not None
    limit = started + scenario.deadline_s
    # A random moment: a step drawn from the first two thirds of the run (time for the recovery to show), then a
    # random fraction of a step or two (steps of the tiny model take ~0.1 s).
    step = rng.randint(scenario.after_step, max(scenario.after_step, scenario.num_rollout * 2 // 3)) \
        if scenario.jitter_s else scenario.after_step
    if not _wait_for_step(process, run_dir, step, limit):
        return {"target": target, "missed": f"the run never reached step {step}"}
    _sleep_unless_exited(process, rng.uniform(0.0, scenario.jitter_s), limit)
    pid = _signal(process, run_dir, target, signal.SIGKILL if scenario.how == "kill" else signal.SIGSTOP)
    if pid is None:
        return {"target": target, "missed": f"no live {target} to signal"}
    done: dict[str, Any] = {"target": target, "pid": pid, "step": trained_steps(run_dir), "at": time.time(),
                            "at_monotonic": time.monotonic()}
    if scenario.how == "kill":
        return done
    stopped.append(pid)
    if scenario.how == "stop":
        _sleep_unless_exited(process, scenario.stop_s, limit)
        with contextlib.suppress(ProcessLookupError):  # killed meanwhile (SIGKILL works on a stopped process)
            os.kill(pid, signal.SIGCONT)
        stopped.remove(pid)
    return done


def _signal(process: subprocess.Popen[str], run_dir: Path, actor: str, signum: int) -> int | None:
    """Send `signum` to the live process of `actor`; its pid, or None if it has none (a restart between reading the
    launcher's log and signalling is retried with the new process)."""
    for _ in range(3):
        pid = current_pid(run_dir, actor)
        if pid is None or process.poll() is not None:
            return None
        try:
            os.kill(pid, signum)
            return pid
        except ProcessLookupError:
            time.sleep(1.0)
    return None


def _deadline(scenario: Scenario, started: float, injected: dict[str, Any]) -> float:
    if scenario.expect == "fails" and "at_monotonic" in injected:
        return injected["at_monotonic"] + (scenario.hang_timeout or 0.0) + FAIL_MARGIN_S
    return started + scenario.deadline_s


def _wait_for_step(process: subprocess.Popen[str], run_dir: Path, step: int, limit: float) -> bool:
    while trained_steps(run_dir) < step:
        if process.poll() is not None or time.monotonic() > limit:
            return False
        time.sleep(POLL_S)
    return True


def _sleep_unless_exited(process: subprocess.Popen[str], seconds: float, limit: float) -> None:
    end = min(time.monotonic() + seconds, limit)
    while time.monotonic() < end and process.poll() is None:
        time.sleep(min(POLL_S, max(0.0, end - time.monotonic())))


def _wait(process: subprocess.Popen[str], deadline: float) -> int | None:
    """The launcher's exit code, or None when it overstayed `deadline`."""
    try:
        return process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return None


def _cleanup(process: subprocess.Popen[str], run_dir: Path, stopped: list[int]) -> None:
    """Nothing of the run outlives it: resume what we stopped (a stopped process cannot take SIGTERM), stop the
    launcher, and kill any of its actors still there (they normally die with it)."""
    for pid in stopped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=STOP_GRACE_S)
    for pid in actor_pids(run_dir):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if _belongs_to(pid, run_dir):
                os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------------------------------------------ reading a run
def launcher_events(run_dir: Path) -> list[dict[str, Any]]:
    return read_metrics(run_dir / LAUNCHER_LOG)


def actor_pids(run_dir: Path) -> set[int]:
    """Every process the launcher started for any actor (restarts included): what cleanup must not leave behind."""
    return {e["pid"] for e in launcher_events(run_dir) if e.get("event") == "actor process started"}


def current_pid(run_dir: Path, actor: str) -> int | None:
    return started_actor_pids(run_dir).get(actor)


def _belongs_to(pid: int, run_dir: Path) -> bool:
    """Whether `pid` is still one of this run's processes (not a later process that reuses the number)."""
    try:
        return f"{RUN_MARK_ENV}={run_dir}\0".encode() in Path(f"/proc/{pid}/environ").read_bytes() + b"\0"
    except OSError:
        return False


def train_walls(run_dir: Path) -> list[float]:
    path = run_dir / "metrics" / "train.jsonl"
    walls = []
    for line in path.read_text(encoding="utf-8").splitlines() if path.exists() else []:
        with contextlib.suppress(json.JSONDecodeError):
            record = json.loads(line)
            if "wall" in record:
                walls.append(float(record["wall"]))
    return walls


def trained_steps(run_dir: Path) -> int:
    path = run_dir / "metrics" / "train.jsonl"
    steps = [0]
    for line in path.read_text(encoding="utf-8").splitlines() if path.exists() else []:
        with contextlib.suppress(json.JSONDecodeError):
            steps.append(int(json.loads(line).get("step", 0)))
    return max(steps)


def bus_fault_counts(run_dir: Path) -> dict[str, int]:
    """Added up over every process of the run (each left its counts in bus-faults/faults-PID.json)."""
    total: dict[str, int] = {}
    for path in (run_dir / "bus-faults").glob("faults-*.json"):
        with contextlib.suppress(OSError, ValueError):
            for key, value in json.loads(path.read_text(encoding="utf-8"))["counts"].items():
                total[key] = total.get(key, 0) + int(value)
    return total


def _declared_dead(run_dir: Path, actor: str) -> bool:
    path = run_dir / "logs" / "controller.jsonl"
    text = path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""
    return any('"member died"' in line and f'"member": "{actor}"' in line for line in text.splitlines())


# ------------------------------------------------------------------------------------------------ verdict
def _judge(outcome: Outcome, scenario: Scenario, run_dir: Path, console: str, injected: dict[str, Any]) -> None:
    code = outcome.exit_code
    outcome.steps = trained_steps(run_dir)
    outcome.outcome = ("timed out" if code is None else "completed" if code == 0 else
                       "failed" if code == 1 else f"exit {code}")
    report = _audit(run_dir)
    outcome.accepted_groups, outcome.trained_groups = report.accepted_groups, report.trained_groups
    outcome.pending_groups, outcome.retrained_batches = report.pending_groups, report.retrained_batches
    outcome.problems = list(report.problems)
    evidence, missing = _evidence(scenario, run_dir, injected)
    outcome.injected = evidence
    reasons = [f"audit: {problem}" for problem in report.problems[:3]]
    if missing:
        reasons.append(missing)
    if scenario.expect == "completes":
        if code != 0:
            reasons.append(f"expected exit 0 within {scenario.deadline_s:g}s, got {outcome.outcome}"
                           + _last_error(console))
        elif outcome.steps != scenario.num_rollout:
            reasons.append(f"trained {outcome.steps} of {scenario.num_rollout} steps")
    else:
        reasons += _attribution_problems(scenario, run_dir, console, code, injected)
    outcome.verdict = "FAIL" if reasons else "PASS"
    outcome.reason = "; ".join(reasons) if reasons else "ok"


def _audit(run_dir: Path) -> AuditReport:
    try:
        return audit(run_dir)
    except Exception as error:  # an unreadable run directory is a failed scenario, not a crashed matrix
        return AuditReport(problems=[f"audit could not read the run: {error!r}"])


def _evidence(scenario: Scenario, run_dir: Path, injected: dict[str, Any]) -> tuple[str, str]:
    """(what the faults did, in counts; why the scenario proves nothing, if it does not). A scenario may combine a
    kill plan and a bus plan with its own kind of fault."""
    parts: list[tuple[str, str]] = []
    if scenario.kill_plan:
        parts.append(_kill_point_evidence(scenario.kill_plan, run_dir))
    if scenario.bus_plan:
        parts.append(_bus_evidence(scenario.bus_plan, run_dir))
    if scenario.how in ("kill", "stop", "stop_left"):
        parts.append(_signal_evidence(scenario, run_dir, injected))
    if not parts:
        return "-", ""
    return "; ".join(text for text, _ in parts), "; ".join(missing for _, missing in parts if missing)


def _kill_point_evidence(plan: str, run_dir: Path) -> tuple[str, str]:
    marks = chaos.fired(run_dir)
    walls = train_walls(run_dir)
    text = ", ".join(f"{'stalled' if '=stall' in str(m['point']) else 'killed'} {m['actor']} pid {m['pid']} at "
                     f"{m['phase']} #{m['n']} "
                     f"({sum(w <= float(m['time']) for w in walls)} steps logged)" for m in marks)
    unfired = [point.name for point in chaos.parse_plan(plan) if point.name not in {m["point"] for m in marks}]
    return text or "nothing fired", f"kill point(s) {', '.join(unfired)} never reached" if unfired else ""


def _bus_evidence(plan_text: str, run_dir: Path) -> tuple[str, str]:
    counts = bus_fault_counts(run_dir)
    text = (f"dropped {counts.get('dropped', 0)}, duplicated {counts.get('duplicated', 0)}, "
            f"delayed {counts.get('delayed', 0)} of {counts.get('messages', 0)} msgs")
    plan = faults.FaultPlan.parse(plan_text)
    wanted = {"dropped": plan.drop, "duplicated": plan.duplicate, "delayed": plan.delay}
    absent = [kind for kind, probability in wanted.items() if probability > 0 and not counts.get(kind)]
    return text, f"no message was {', '.join(absent)}" if absent else ""


def _signal_evidence(scenario: Scenario, run_dir: Path, injected: dict[str, Any]) -> tuple[str, str]:
    if "missed" in injected:
        return "nothing injected", injected["missed"]
    target, step = injected["target"], injected["step"]
    if scenario.how == "kill":
        return f"killed {target} pid {injected['pid']} at step {step}", ""
    if scenario.how == "stop":
        dead = _declared_dead(run_dir, target)
        text = f"stopped {target} {scenario.stop_s:g}s at step {step}" + ("; declared dead" if dead else "")
        return text, "" if dead else f"{target} was never declared dead: the stop did not outlast its heartbeat"
    return f"stopped {target} at step {step}, left stopped", ""


def _attribution_problems(scenario: Scenario, run_dir: Path, console: str, code: int | None,
                          injected: dict[str, Any]) -> list[str]:
    """A run expected to fail must fail (exit 1) in time, saying which actor it waited on."""
    problems = []
    limit = (scenario.hang_timeout or 0.0) + FAIL_MARGIN_S
    if code != 1:
        problems.append(f"expected exit 1 within {limit:g}s of the stop, got "
                        f"{'no exit' if code is None else f'exit {code}'}")
    target = injected.get("target", "")
    text = console + "\n" + _read(run_dir / "logs" / "launcher-0.jsonl") + "\n" + _read(run_dir / "hang-report.txt")
    if "run failed" not in text and "run hung" not in text:
        problems.append("no 'run failed' in the output")
    naming = [line for line in text.splitlines() if "silent" in line and target in line]
    if target and not naming and f"{target} (pid" not in _read(run_dir / "hang-report.txt"):
        problems.append(f"the failure does not name the stopped actor {target}")
    return problems


def _last_error(console: str) -> str:
    lines = [line for line in console.splitlines() if "error" in line.lower() or "failed" in line.lower()]
    return f" (last error: {lines[-1][:200]})" if lines else ""


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
