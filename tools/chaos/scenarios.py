"""The chaos matrix's scenarios: which fault, injected how and when, and what the run must do about it.

Five ways to inject a fault, one per `Scenario.how` (a scenario may add a bus plan to any of them):

- ``kill_point``: an actor kills itself with SIGKILL at a named phase (actors/runtime/chaos.py), so the kill lands
  exactly mid-generate, mid-weight-push, mid-checkpoint, while a batch is served, or mid-scoring; or it stalls
  there for some seconds (``=stall:SECONDS``), frozen as by a short SIGSTOP but at a chosen moment;
- ``kill``: this tool sends SIGKILL to an actor (a named one, or one picked at random) at a random moment after a
  given step: the faults nobody placed;
- ``stop``: SIGSTOP of an actor for `stop_s` seconds (past its heartbeat deadline, so it is declared dead), then
  SIGCONT: a process that comes back from the dead with its old leases and connections;
- ``stop_left``: SIGSTOP of a singleton that is never resumed; only the hang detector (`--hang-timeout`) can end the
  run, and it must fail it naming the stopped actor;
- ``bus``: a fault plan for every bus socket of every process (bus/faults.py): drop, duplicate, delay.

Expected outcomes: "completes" (exit 0, every step trained) or "fails" (exit 1 within hang_timeout + 30 s of the
stop, the stopped actor named). Either way the audit (tools/audit_run.py) must pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Expect = Literal["completes", "fails"]
How = Literal["kill_point", "kill", "stop", "stop_left", "bus", "none"]
KILLABLE = ("controller", "buffer", "learner", "rollout-0-0", "reward-0-0")
FAIL_MARGIN_S = 30.0  # a failed run must end within hang_timeout + this after the stop


@dataclass(frozen=True)
class Scenario:
    name: str
    how: How
    expect: Expect = "completes"
    kill_plan: str | None = None  # SLIPSTREAM_CHAOS_KILL, for kill_point
    bus_plan: str | None = None  # SLIPSTREAM_BUS_FAULTS, for bus
    target: str | None = None  # actor id for kill/stop/stop_left; "random" for kill: one of KILLABLE
    after_step: int = 3  # kill/stop/stop_left: once this many steps are trained ...
    jitter_s: float = 0.0  # ... or, when > 0, a random moment: a random later step plus up to this many seconds
    stop_s: float = 4.0  # stop: how long the actor stays stopped
    seed: int = 0  # the random choices of this scenario
    num_rollout: int = 12
    hang_timeout: float | None = None  # --hang-timeout for the run (None: the launcher's default)
    deadline_s: float = 150.0  # a "completes" run must end within this
    extra: tuple[str, ...] = field(default_factory=tuple)  # more launcher flags

    @property
    def fault(self) -> str:
        """The fault(s) in a few words, for the table."""
        parts = []
        if self.kill_plan:
            parts.append(f"{'stall' if '=stall' in self.kill_plan else 'kill -9'} at {self.kill_plan}")
        if self.bus_plan:
            parts.append(f"bus {self.bus_plan}")
        if self.how == "kill":
            when = f"a random moment after step {self.after_step}" if self.jitter_s else f"step {self.after_step}"
            parts.append(f"kill -9 {self.target} at {when}")
        elif self.how == "stop":
            parts.append(f"SIGSTOP {self.target} {self.stop_s:g}s at step {self.after_step}, SIGCONT")
        elif self.how == "stop_left":
            parts.append(f"SIGSTOP {self.target} at step {self.after_step}, left stopped")
        if "--max-staleness" in self.extra:
            parts.append(f"max-staleness {self.extra[self.extra.index('--max-staleness') + 1]}")
        return "; ".join(parts) or "none"


def _kill_points() -> list[Scenario]:
    return [
        Scenario("kill-learner-mid-weight-push", "kill_point", kill_plan="learner@weight_push.mid#6"),
        Scenario("kill-buffer-mid-batch-serve", "kill_point", kill_plan="buffer@batch_serve.mid#5"),
        Scenario("kill-learner-mid-checkpoint", "kill_point", kill_plan="learner@checkpoint.mid#1"),
        Scenario("kill-rollout-mid-generate", "kill_point", kill_plan="rollout-0-0@generate.mid#4"),
        Scenario("kill-reward-mid-scoring", "kill_point", kill_plan="reward-0-0@score.mid#6"),
    ]


BUS_MIXED = "drop=0.02,duplicate=0.02,delay=0.05,delay_ms=5-100,seed=7"
# A synchronous run whose fifth weight push finds one engine frozen for 3 s: past the 2 s transfer timeout (the push
# fails), within the 5 s heartbeat deadline (nobody is declared dead, so no re-join triggers a new push).
SYNC_STALLED_PUSH = Scenario(
    "sync-stall-rollout-mid-weight-push", "kill_point", kill_plan="rollout-0-1@weight_load.start#5=stall:3",
    extra=("--max-staleness", "0", "--heartbeat-interval", "1", "--weight-transfer-timeout", "2"), deadline_s=90)
# Two kills in one run: a batch logged as served whose reply never left, and a scored group never handed on.
BUFFER_AND_REWARD_KILLED = Scenario(
    "kill-buffer-mid-batch-serve-and-reward-mid-scoring", "kill_point",
    kill_plan="buffer@batch_serve.mid#5,reward-0-0@score.mid#3", deadline_s=80)


def full_matrix() -> list[Scenario]:
    """Every fault the issue names, each role killed at each of its phases and at a random moment."""
    return [
        Scenario("baseline", "none"),
        *_kill_points(),
        Scenario("kill-learner-mid-weight-push-early", "kill_point", kill_plan="learner@weight_push.mid#3"),
        Scenario("kill-learner-mid-second-checkpoint", "kill_point", kill_plan="learner@checkpoint.mid#2"),
        Scenario("kill-learner-mid-final-checkpoint", "kill_point", kill_plan="learner@checkpoint.mid#4"),
        Scenario("kill-buffer-twice", "kill_point", kill_plan="buffer@batch_serve.mid#3,buffer@batch_serve.mid#6"),
        Scenario("kill-storm", "kill_point", num_rollout=20, deadline_s=240,
                 kill_plan="learner@weight_push.mid#4,buffer@batch_serve.mid#7,rollout-0-0@generate.mid#5,"
                           "reward-0-0@score.mid#9,learner@checkpoint.mid#2,rollout-0-1@generate.mid#12"),
        Scenario("kill-learner-on-a-faulty-bus", "kill_point", kill_plan="learner@weight_push.mid#6",
                 bus_plan=BUS_MIXED, deadline_s=240),
        Scenario("sync-kill-learner-mid-weight-push", "kill_point", kill_plan="learner@weight_push.mid#6",
                 extra=("--max-staleness", "0")),
        Scenario("sync-kill-buffer-mid-batch-serve", "kill_point", kill_plan="buffer@batch_serve.mid#5",
                 extra=("--max-staleness", "0")),
        SYNC_STALLED_PUSH,
        # Steps of the tiny model take ~0.1 s and the tool polls, so a kill lands a few steps after the one drawn:
        # runs of 24 steps keep it inside the training, not in the shutdown.
        Scenario("kill-controller-random", "kill", target="controller", after_step=2, jitter_s=0.3, seed=1,
                 num_rollout=24),
        *(Scenario(f"kill-random-role-{seed}", "kill", target="random", after_step=2, jitter_s=0.3, seed=seed,
                   num_rollout=24)
          for seed in (1, 5, 7, 9)),  # seeds that pick buffer, reward, learner, rollout
        Scenario("bus-drop", "bus", bus_plan="drop=0.03,seed=1"),
        Scenario("bus-duplicate", "bus", bus_plan="duplicate=0.1,seed=2"),
        Scenario("bus-delay", "bus", bus_plan="delay=0.2,delay_ms=20-200,seed=3"),
        Scenario("bus-mixed", "bus", bus_plan=BUS_MIXED),
        Scenario("bus-heavy", "bus", bus_plan="drop=0.08,duplicate=0.05,delay=0.1,delay_ms=20-300,seed=4",
                 deadline_s=240),
        Scenario("kill-learner-then-buffer", "kill_point",
                 kill_plan="learner@weight_push.mid#6,buffer@batch_serve.mid#9"),
        BUFFER_AND_REWARD_KILLED,
        Scenario("stop-rollout-past-heartbeat", "stop", target="rollout-0-1", after_step=3, stop_s=4.0),
        Scenario("stop-reward-past-heartbeat", "stop", target="reward-0-0", after_step=3, stop_s=4.0),
        Scenario("stop-learner-past-heartbeat", "stop", target="learner", after_step=3, stop_s=4.0),
        Scenario("stop-buffer-past-heartbeat", "stop", target="buffer", after_step=3, stop_s=4.0),
        Scenario("stop-learner-left-stopped", "stop_left", expect="fails", target="learner", after_step=3,
                 hang_timeout=8.0),
        Scenario("stop-controller-left-stopped", "stop_left", expect="fails", target="controller", after_step=3,
                 hang_timeout=8.0),
        Scenario("stop-buffer-left-stopped", "stop_left", expect="fails", target="buffer", after_step=3,
                 hang_timeout=8.0),
    ]


def quick_matrix() -> list[Scenario]:
    """A few minutes on two cores: one kill at each phase, the bus faults together, both kinds of SIGSTOP."""
    return [
        *_kill_points(),
        Scenario("bus-mixed", "bus", bus_plan=BUS_MIXED),
        SYNC_STALLED_PUSH,
        Scenario("stop-rollout-past-heartbeat", "stop", target="rollout-0-1", after_step=3, stop_s=4.0),
        Scenario("stop-learner-left-stopped", "stop_left", expect="fails", target="learner", after_step=3,
                 hang_timeout=8.0),
    ]


def ci_matrix() -> list[Scenario]:
    """The most telling few, for tests/system/test_chaos.py, in two runs (the suite's time is bounded): the two
    kills whose recovery is subtlest (a weight push cut between broadcast and acknowledgement, on a bus that drops,
    duplicates and delays every kind of message; a batch logged as served whose reply never left), the second run
    also killing the reward worker with a scored group not yet handed on (a kill point the full matrix alone had
    exercised, and lost without notice when rewards began to score inline)."""
    return [
        Scenario("kill-learner-on-a-faulty-bus", "kill_point", kill_plan="learner@weight_push.mid#6",
                 bus_plan=BUS_MIXED, deadline_s=80),
        BUFFER_AND_REWARD_KILLED,
    ]


MATRICES = {"full": full_matrix, "quick": quick_matrix, "ci": ci_matrix}
