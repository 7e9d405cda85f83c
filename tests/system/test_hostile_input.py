"""Hostile input on every bound socket of a live run (issue #17): `python -m tools.hostile.campaign --quick`, the CI
version.

About 13,000 hostile frames of every kind reach every socket the run bound while it trains; no actor crashes, the
run trains all its steps and passes the exactly-once audit, every frame an actor could see is counted under
the peer that sent it, and no actor's resident memory grows by more than the tool's bound: 32 MiB for the
interpreter and the bounded tables, plus 64 KiB per connection the attack made to the actor (libzmq's own cost
is ~28 KiB), about 40 MiB here; the quick run's largest growth measured was 12 MiB.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.summary import add_summary

REPO = Path(__file__).resolve().parents[2]
EXACT_KINDS = {"random", "truncated", "wrong_types", "envelope", "identity", "idents", "credit", "not_sub",
               "pub_envelope"}


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> tuple[dict[str, Any], str]:
    work = tmp_path_factory.mktemp("hostile")
    out = work / "figures.json"
    result = subprocess.run([sys.executable, "-m", "tools.hostile.campaign", "--quick", "--json", str(out),
                             "--run-dir", str(work / "run")], cwd=REPO, capture_output=True, text=True, timeout=280)
    add_summary(request.config, "hostile input (tools/hostile/campaign.py --quick)", result.stdout)  # for the CI log
    assert out.exists(), f"no figures (exit {result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    figures = json.loads(out.read_text(encoding="utf-8"))
    assert result.returncode == 0, f"{figures['problems']}\n{result.stdout[-6000:]}\n{result.stderr[-2000:]}"
    return figures, result.stdout


@pytest.mark.system
@pytest.mark.timeout(300)
def test_no_actor_crashes_and_the_run_completes(hostile: tuple[dict[str, Any], str]) -> None:
    figures, _ = hostile
    assert figures["frames"] >= 10_000
    assert figures["crashes"] == {}
    assert figures["exit_code"] == 0 and figures["trained_steps"] == figures["steps"]
    assert figures["audit_ok"], "a replayed frame was trained twice or an accepted sample was lost"


@pytest.mark.system
@pytest.mark.timeout(300)
def test_every_bound_socket_is_targeted_with_every_kind(hostile: tuple[dict[str, Any], str]) -> None:
    figures, _ = hostile
    # controller rpc + publish, buffer inbox + rpc, reward inbox, learner rpc, two rollout workers' rpc and engines
    assert len(figures["endpoints"]) == 10 and figures["targeted"] == figures["endpoints"]
    kinds = {attack["socket"]: set() for attack in figures["attacks"]}
    for attack in figures["attacks"]:
        kinds[attack["socket"]].add(attack["kind"])
    router = {"random", "truncated", "wrong_types", "envelope", "identity", "idents", "replay", "oversized",
              "bad_greeting", "unfinished"}
    for socket, seen in kinds.items():
        if socket.endswith("/publish"):
            assert seen == {"subs", "not_sub", "pub_envelope", "oversized", "bad_greeting"}, socket
        else:
            assert router <= seen, f"{socket}: {router - seen} not sent"
        if socket.endswith("/inbox"):
            assert {"no_hello", "credit", "hellos"} <= seen, socket
    assert {"claims", "registers"} <= kinds["controller/rpc"]
    assert {"rollout-0-0/engine", "rollout-0-1/engine"} <= set(kinds)  # served engines are attacked like any socket


@pytest.mark.system
@pytest.mark.timeout(300)
def test_every_frame_is_counted_by_its_receiver_under_its_sender(hostile: tuple[dict[str, Any], str]) -> None:
    figures, table = hostile
    failed = [attack for attack in figures["attacks"] if not attack["ok"]]
    assert not failed, f"{failed}\n{table}"
    for attack in figures["attacks"]:
        assert attack["unsent"] == 0, attack
        if attack["kind"] in EXACT_KINDS:
            assert attack["counted"] != "nothing", attack
    assert "counted by the receiver" in table


@pytest.mark.system
@pytest.mark.timeout(300)
def test_resident_memory_stays_within_the_bound(hostile: tuple[dict[str, Any], str]) -> None:
    figures, _ = hostile
    for actor, rss in figures["rss_mib"].items():
        bound = figures["rss_bound_mib"][actor]
        assert bound <= 64, f"{actor}: a bound of {bound} MiB proves little"
        assert rss["peak"] - rss["before"] <= bound, f"{actor}: {rss}"
