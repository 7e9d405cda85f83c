"""Hostile input on every bound socket of a live run (issue #17): no crash, every drop counted, memory bounded.

    python -m tools.hostile.campaign --quick              # ~13k frames, as CI (tests/system/test_hostile_input.py)
    python -m tools.hostile.campaign                      # the full version: >= 100,000 frames
    python -m tools.hostile.campaign --json figures.json  # the figures, for the closing note

It starts a small real run (launcher.py; the real controller, buffer, reward worker, two rollout workers and
learner, with only their compute sleeping, see tools/hostile/run.py), finds every socket the run bound (each
actor's inbox and rpc endpoints, the controller's head address and broadcast publisher) and, while the run
trains, sends each of them frames of every hostile kind below from many connections. Then it reads what the
receivers counted from their own heartbeat counters (metrics/actors.jsonl), samples every actor's resident
memory throughout, lets the run finish and audits it. It prints one table and exits non-zero when an invariant
fails: an actor crashed, the run did not train all its steps, a frame was not counted where it should be, a
socket was not targeted, or an actor's memory grew past the bound.

Kinds (ROUTER = stream inboxes and RPC servers; each kind's connections carry routing id "hostile-KIND#nonce", so
the receiver's per-peer drop table attributes them):
  random        random bytes (never a valid map)                         -> decode drop, exact per peer
  truncated     real messages cut short                                  -> bad_msgpack, exact per peer
  wrong_types   valid msgpack maps: known types with wrong field types, unknown types, wrong or missing versions
  envelope      multipart messages of the wrong shape (RPC: no/empty/65-byte request id, a part too many)
  identity      garbage from routing ids that are real actors' names     -> counted under that name, exact
  idents        garbage from many connections with random routing ids   -> the bounded table's "(other)" row
  replay        stream: real ScoredGroups captured from the buffer's log, sent again (must be ignored, and the
                audit must find nothing trained twice); RPC: the same request id sent 5 times (answered once)
  no_hello      stream: valid data from a sender that never said hello (ignores credit) -> over_credit
  credit        stream: StreamCredit sent to a receiver                  -> unexpected, exact
  hellos        stream: a hello with a fresh session each time, credits read only afterwards -> each answered
                or counted as credit_unread
  claims        controller: Heartbeat/Register/Leave/StateReport/VersionAnnouncement in a real actor's name
  registers     controller: Register of random names (admitted: the run has no CURVE keys; measured, see docs)
  oversized     raw ZMTP: a frame header claiming one byte more than the socket's limit -> connection dropped
  bad_greeting  raw TCP: a ZMTP greeting with an unknown mechanism       -> connection dropped
  unfinished    raw ZMTP: a multipart message never finished, then the connection closed
  subs          publisher: a subscription flood (random topics, real topics, everything) from many connections
  not_sub       publisher: frames that are not subscriptions             -> not_subscription, exact
  pub_envelope  publisher: multipart messages upstream                   -> bad_envelope, exact
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from tools.audit_run import audit
from tools.hostile.judge import Counters, judge
from tools.hostile.plan import FULL, QUICK, Attack, Mode, captured_frames, plan
from tools.hostile.run import HEARTBEAT_S, Endpoint, RssSampler, Run, launch, wait_until

# controller rpc + publish, buffer inbox + rpc, reward inbox, the learner's rpc (the evaluator's weight pins), and
# each of the two rollout workers' rpc and engine (its engine served to the other's router): the attack waits until
# every one is bound
EXPECTED_ENDPOINTS = 10
# Resident memory an actor may gain under attack: a fixed allowance for the interpreter and every bounded table
# (drop rows, stream accounts, reply cache), plus what libzmq and the actor keep per connection the attacker opened
# (libzmq alone: ~28 KiB, measured with a bare ROUTER; glibc keeps it after the connection closes).
RSS_BASE_MB = 32.0
RSS_PER_CONNECTION_KB = 64.0
SEND_TIMEOUT_MS = 5000
LINGER_MS = 15000


# ---------------------------------------------------------------------------------------------- sending
def execute(attacks: list[Attack], rng: random.Random) -> None:
    """Send every attack's messages, interleaved so that every socket is under fire at once; then the raw ones."""
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 16384)  # the full mode opens ~3,000 connections (libzmq's default cap: 1,023)
    sockets: dict[int, list[zmq.Socket]] = {}
    try:
        for index, attack in enumerate(attacks):
            if attack.raw is None:
                sockets[index] = [_connect(ctx, attack, ident) for ident in attack.idents]
        time.sleep(0.5)  # let the connections come up, so the first frames are not queued behind handshakes
        longest = max((len(attack.messages) for attack in attacks), default=0)
        for position in range(longest):
            for index, attack in enumerate(attacks):
                if position < len(attack.messages):
                    connection = sockets[index][position % len(sockets[index])]
                    try:
                        connection.send_multipart(attack.messages[position])
                        attack.sent += 1
                    except zmq.Again:
                        attack.unsent += 1
        for attack in attacks:
            if attack.raw is not None:
                attack.closed = sum(attack.raw(attack.endpoint, rng) for _ in attack.idents)
        for index, attack in enumerate(attacks):
            if attack.kind == "hellos":
                attack.answered = _read_credits(sockets[index][0])
    finally:
        for connections in sockets.values():
            for connection in connections:
                connection.close(linger=LINGER_MS)
        ctx.term()  # returns once every queued frame is out (or the linger expired)


def _connect(ctx: zmq.Context, attack: Attack, ident: bytes) -> zmq.Socket:
    sock = ctx.socket(zmq.XSUB if attack.endpoint.channel == "publish" else zmq.DEALER)
    sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
    if attack.endpoint.channel != "publish":
        sock.setsockopt(zmq.ROUTING_ID, ident)
    sock.connect(attack.endpoint.address)
    return sock


def _read_credits(sock: zmq.Socket, quiet_s: float = 2.0) -> int:
    """Credits that came back on the hello-flood connection (read only now, after the flood)."""
    count = 0
    while sock.poll(int(quiet_s * 1000)):
        sock.recv()
        count += 1
    return count


# ---------------------------------------------------------------------------------------------- the run
@dataclass
class Outcome:
    mode: str
    frames: int
    attack_s: float
    endpoints: list[str]
    targeted: list[str]
    attacks: list[Attack]
    crashes: dict[str, int]
    rss: dict[str, tuple[float, float, float]]
    exit_code: int | None
    trained: int
    steps: int
    audit_ok: bool
    audit_problems: list[str]
    rss_bound_mb: dict[str, float]
    problems: list[str] = field(default_factory=list)


def attack_run(run: Run, mode: Mode, seed: int, rss_base_mb: float) -> Outcome:
    rng = random.Random(seed)
    endpoints = wait_until(lambda: _all_endpoints(run), 180, "bound endpoints of every actor", run)
    wait_until(lambda: run.trained_steps() >= 2, 180, "trained steps", run)
    pids = run.pids()
    actor_ids = sorted(pids)
    captured = captured_frames(run)
    attacks = plan(endpoints, mode, rng, actor_ids, captured)
    before = (run.metrics_lines() or [{}])[-1]
    sampler = RssSampler(pids)
    started = time.monotonic()
    print(f"attacking {len(endpoints)} sockets with {sum(len(a.messages) or len(a.idents) for a in attacks)} "
          f"frames ({mode.name}) while the run trains ...", flush=True)
    execute(attacks, rng)
    attack_s = time.monotonic() - started
    settled = time.time() + 2 * HEARTBEAT_S + 0.5  # two heartbeats after the last frame
    print(f"sent in {attack_s:.1f}s; waiting for the receivers' counters ...", flush=True)
    after = wait_until(lambda: next((line for line in reversed(run.metrics_lines())
                                     if line.get("wall", 0) >= settled), None), 30,
                       "heartbeat record after the attack", run)
    judge(attacks, Counters(before, after), actor_ids)
    if not all(attack.ok for attack in attacks) and run.process.poll() is None:
        time.sleep(5.5)  # a receiver still working through its queue: one more record
        latest = run.metrics_lines()[-1]
        if latest.get("wall", 0) > after.get("wall", 0):
            judge(attacks, Counters(before, latest), actor_ids)
    sampler.stop()
    run.release()
    exit_code = _wait_for_exit(run)
    report = audit(run.run_dir)
    return Outcome(
        mode=mode.name, frames=sum(attack.frames for attack in attacks), attack_s=attack_s,
        endpoints=[endpoint.name for endpoint in endpoints],
        targeted=sorted({attack.endpoint.name for attack in attacks if attack.frames}),
        attacks=attacks, crashes=run.crashes(),
        rss={actor: (sampler.before[actor], sampler.peak[actor], sampler.latest[actor]) for actor in pids},
        exit_code=exit_code, trained=run.trained_steps(), steps=run.steps, audit_ok=report.ok,
        audit_problems=report.problems[:5], rss_bound_mb=rss_bounds(attacks, pids, rss_base_mb),
    )


def rss_bounds(attacks: list[Attack], pids: dict[str, int], base_mb: float) -> dict[str, float]:
    """Per actor: the fixed allowance plus RSS_PER_CONNECTION_KB for every connection made to its sockets."""
    connections = dict.fromkeys(pids, 0)
    for attack in attacks:
        connections[attack.endpoint.actor] = connections.get(attack.endpoint.actor, 0) + len(attack.idents)
    return {actor: base_mb + count * RSS_PER_CONNECTION_KB / 1024 for actor, count in connections.items()}


def _all_endpoints(run: Run) -> list[Endpoint] | None:
    found = run.endpoints()
    return found if len(found) >= EXPECTED_ENDPOINTS else None


def _wait_for_exit(run: Run) -> int | None:
    try:
        return run.process.wait(timeout=120 + 3 * run.steps)
    except Exception:
        return None


def invariants(outcome: Outcome) -> list[str]:
    problems = []
    if outcome.frames < (100_000 if outcome.mode == "full" else 10_000):
        problems.append(f"only {outcome.frames} frames sent")
    if any(outcome.crashes.values()):
        problems.append(f"actors crashed: {outcome.crashes}")
    if outcome.exit_code != 0 or outcome.trained < outcome.steps:
        problems.append(f"the run did not complete: exit {outcome.exit_code}, {outcome.trained}/{outcome.steps} "
                        f"steps trained")
    if not outcome.audit_ok:
        problems.append(f"audit failed: {outcome.audit_problems}")
    missed = sorted(set(outcome.endpoints) - set(outcome.targeted))
    if missed or len(outcome.endpoints) < EXPECTED_ENDPOINTS:
        problems.append(f"sockets not targeted: {missed or 'fewer endpoints than expected'}")
    for attack in outcome.attacks:
        if not attack.ok:
            problems.append(f"{attack.endpoint.name} {attack.kind}: sent {attack.sent} (unsent {attack.unsent}), "
                            f"counted {attack.counted}")
    for actor, (before, peak, _) in outcome.rss.items():
        bound = outcome.rss_bound_mb[actor]
        if peak - before > bound:
            problems.append(f"{actor}: resident memory grew {peak - before:.0f} MiB (bound {bound:.0f} MiB)")
    return problems


# ---------------------------------------------------------------------------------------------- output
def table(outcome: Outcome) -> str:
    lines = [f"{'socket':<22} {'kind':<13} {'frames':>7}  counted by the receiver", "-" * 118]
    current = ""
    for attack in sorted(outcome.attacks, key=lambda a: (a.endpoint.name, a.kind)):
        name = attack.endpoint.name
        if name != current:
            current = name
            before, peak, after = outcome.rss.get(attack.endpoint.actor, (0.0, 0.0, 0.0))
            crashes = outcome.crashes.get(attack.endpoint.actor, 0)
            bound = outcome.rss_bound_mb.get(attack.endpoint.actor, 0.0)
            lines.append(f"{name:<22} crashes {crashes}, RSS MiB before/peak/after "
                         f"{before:.0f}/{peak:.0f}/{after:.0f} (growth bound {bound:.0f})")
        mark = "" if attack.ok else "  <-- FAILED"
        lines.append(f"{'':<22} {attack.kind:<13} {attack.frames:>7}  {attack.counted}{mark}")
    attacked = {attack.endpoint.actor for attack in outcome.attacks}
    for actor, (before, peak, after) in sorted(outcome.rss.items()):
        if actor not in attacked:  # binds nothing (the learner), but shares the machine and the run
            lines.append(f"{actor + ' (no socket)':<22} crashes {outcome.crashes.get(actor, 0)}, RSS MiB "
                         f"before/peak/after {before:.0f}/{peak:.0f}/{after:.0f}")
    lines.append("-" * 118)
    lines.append(f"{outcome.frames} frames to {len(outcome.targeted)}/{len(outcome.endpoints)} bound sockets in "
                 f"{outcome.attack_s:.1f}s; crashes {sum(outcome.crashes.values())}; run exit {outcome.exit_code}, "
                 f"{outcome.trained}/{outcome.steps} steps trained; audit {'OK' if outcome.audit_ok else 'FAILED'}")
    return "\n".join(lines)


def figures(outcome: Outcome) -> dict[str, Any]:
    return {
        "mode": outcome.mode, "frames": outcome.frames, "attack_s": round(outcome.attack_s, 2),
        "endpoints": outcome.endpoints, "targeted": outcome.targeted, "crashes": outcome.crashes,
        "exit_code": outcome.exit_code, "trained_steps": outcome.trained, "steps": outcome.steps,
        "audit_ok": outcome.audit_ok, "rss_mib": {actor: dict(zip(("before", "peak", "after"), values, strict=True))
                                                  for actor, values in outcome.rss.items()},
        "rss_bound_mib": outcome.rss_bound_mb,
        "attacks": [{"socket": a.endpoint.name, "kind": a.kind, "frames": a.frames, "unsent": a.unsent,
                     "counted": a.counted, "ok": a.ok} for a in outcome.attacks],
        "problems": outcome.problems, "ok": not outcome.problems,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="~13k frames (CI); default: >= 100,000")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--run-dir", type=Path, help="where the run writes (default: a temporary directory)")
    parser.add_argument("--steps", type=int, help="training steps of the run (its last waits for the attack's end)")
    parser.add_argument("--step-seconds", type=float, default=0.5, help="simulated time of one training step")
    parser.add_argument("--rss-base-mb", type=float, default=RSS_BASE_MB,
                        help=f"growth of an actor's resident memory accepted besides {RSS_PER_CONNECTION_KB:.0f} KiB "
                             f"per connection made to it")
    parser.add_argument("--seed", type=int, default=17)
    args = parser.parse_args(argv)
    mode = QUICK if args.quick else FULL
    with tempfile.TemporaryDirectory(prefix="hostile-") as scratch:
        run_dir = args.run_dir or Path(scratch) / "run"
        run = launch(run_dir, args.steps or mode.steps, args.step_seconds)
        try:
            outcome = attack_run(run, mode, args.seed, args.rss_base_mb)
        except RuntimeError as error:
            print(f"hostile: {error}", file=sys.stderr)
            return 2
        finally:
            run.release()  # a learner held in its last step would stop only at the end of its drain timeout
            if run.process.poll() is None:
                run.process.send_signal(signal.SIGTERM)
                run.process.wait(timeout=60)
        outcome.problems = invariants(outcome)
        print(table(outcome))
        if args.json:
            args.json.write_text(json.dumps(figures(outcome), indent=2), encoding="utf-8")
        for problem in outcome.problems:
            print(f"FAILED: {problem}", file=sys.stderr)
        return 1 if outcome.problems else 0


if __name__ == "__main__":
    sys.exit(main())
