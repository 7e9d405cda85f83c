"""A learner on two nodes (`--actor-num-nodes 2`): rank 0 on the head, rank 1 started by node 1's launcher, one
data-parallel world across the nodes. Losing node 1's rank is one learner restart, resumed from its checkpoint,
and every batch is still trained exactly once, whether the rank dies (its peers see the connection go) or hangs
(SIGSTOP: rank 0 sees its heartbeat stop, and node 1's actor ends the hung rank once rank 0's world is gone); one
run loses it both ways, one after the other.

Each node is a network namespace with its own address where namespaces can be made (else a loopback address of
its own on this machine), so the world's gloo traffic crosses a virtual network (`tests/support/netns.py`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bus.address import free_port
from tests.system.test_elastic_nodes import Node, nodes, wait  # noqa: F401 - `nodes` is a fixture
from tests.system.test_fault_tolerance import finish, launch, trained_steps
from tools.audit_run import audit
from tools.make_arithmetic_data import make_arithmetic_data

REPO = Path(__file__).resolve().parents[2]


def start_two_nodes(tmp_path: Path, model: Path, cluster: list[Node], steps: int, *flags: str
                    ) -> tuple[Path, subprocess.Popen[str], subprocess.Popen[str]]:
    """The head (rank 0 of a learner on two nodes, one rank each) and node 1; their run directory."""
    data = make_arithmetic_data(tmp_path / "data", max_operand=9, eval_size=10)["train"]
    head_node, learner_node = cluster[0], cluster[1]
    run_dir, head_address = tmp_path / "run", f"tcp://{head_node.address}:{free_port('127.0.0.1')}"
    head = launch(run_dir, model, data, num_rollout=steps, node=head_node.command,
                  extra=("--head-address", head_address, "--host", head_node.address, "--rollout-workers", "1",
                         "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "1", "--save-interval", "2", *flags))
    return run_dir, head, start_learner_node(learner_node, run_dir, head_address)


def start_learner_node(node: Node, run_dir: Path, head: str) -> subprocess.Popen[str]:
    """Node 1 of the learner: its learner ranks, and one rollout worker beside them."""
    command = [sys.executable, str(REPO / "launcher.py"), "--head-address", head, "--node-rank", str(node.rank),
               "--host", node.address, "--run-dir", str(run_dir), "--rollout-workers", "1", "--reward-workers", "0",
               "--heartbeat-interval", "0.25", "--restart-backoff", "0.2", "--no-progress"]
    return subprocess.Popen(node.command(command), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def finish_both(head: subprocess.Popen[str], other: subprocess.Popen[str], run_dir: Path, timeout: float) -> None:
    """Both launchers to the end of the run, each exiting 0."""
    try:
        output = finish(head, timeout=timeout)
        other_output = finish(other, timeout=120)
    finally:
        stop_all(head, other, run_dir)
    assert head.returncode == 0, output[-4000:]
    assert other.returncode == 0, other_output[-4000:]


def stop_all(head: subprocess.Popen[str], other: subprocess.Popen[str], run_dir: Path) -> None:
    for process in (head, other):
        if process.poll() is None:
            process.kill()
    for pid in rank_pids(run_dir):  # a SIGSTOPped rank outlives its launcher
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def log_records(run_dir: Path, name: str) -> list[dict]:
    path = run_dir / "logs" / f"{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def rank_pids(run_dir: Path) -> list[int]:
    """The pids of node 1's learner ranks, newest set last."""
    return [pid for record in log_records(run_dir, "learner-ranks-1-0")
            if record.get("event") == "learner ranks started" for pid in record["pids"]]


@pytest.mark.system
@pytest.mark.timeout(600)
def test_a_learner_on_two_nodes_trains_as_one_world_and_survives_losing_the_other_nodes_rank(
    tmp_path: Path, tiny_model_path: Path, nodes: list[Node]  # noqa: F811 - the fixture
) -> None:
    """One run, both losses: node 1's rank is killed mid-run, then the rank that replaced it hangs (SIGSTOP) in the
    next world. Neither can happen before the world trains again: rank 0 steps only together with rank 1. Each
    loss comes after a checkpoint (every 2 steps) and before the last step, so each world resumes from one and the
    run cannot end without the next world."""
    steps = 16
    run_dir, head, other = start_two_nodes(tmp_path, tiny_model_path, nodes, steps)
    try:
        wait(lambda: trained_steps(run_dir) >= 4, "four steps of the two-node learner", timeout=240, run_dir=run_dir)
        first_set = rank_pids(run_dir)
        assert len(first_set) == 1
        os.kill(first_set[0], signal.SIGKILL)  # node 1's rank dies mid-run: its peers see the connection go
        wait(lambda: len(rank_pids(run_dir)) >= 2, "node 1 to start a fresh rank", timeout=120, run_dir=run_dir)
        wait(lambda: trained_steps(run_dir) >= 8, "the second world to train past the first loss", timeout=240,
             run_dir=run_dir)
        hung_at, second_set = len(log_records(run_dir, "learner")), rank_pids(run_dir)
        os.kill(second_set[-1], signal.SIGSTOP)  # the fresh rank hangs mid-run: nothing breaks a connection
        wait(lambda: len(rank_pids(run_dir)) > len(second_set), "node 1 to replace its hung rank", timeout=120,
             run_dir=run_dir)
    except BaseException:
        stop_all(head, other, run_dir)
        raise
    finish_both(head, other, run_dir, timeout=400)
    learner = log_records(run_dir, "learner")
    joined = [record for record in learner if record.get("event") == "learner ranks of the other nodes joined"]
    assert len(joined) >= 3 and joined[0]["ranks"] == "1-1", joined  # the first world, and one after each loss
    assert sum(record.get("event") == "resumed from checkpoint" for record in learner) >= 2
    # the hang broke no connection: rank 0's heartbeat watch ended the world it hung
    assert any(record.get("event", "").startswith("a learner rank on another node fell silent")
               for record in learner[hung_at:]), [record.get("event") for record in learner[hung_at:]]
    rank_log = (run_dir / "logs" / "learner-rank-1.log").read_text()
    assert rank_log.count("learner rank 1/2 ready") >= 3, rank_log[-2000:]
    report = audit(run_dir)
    assert report.ok, report.problems
    assert report.trained_batches == steps
    if nodes[1].namespace is not None:  # the world's traffic crossed the virtual network
        assert nodes[1].namespace.cable_bytes() > 1_000_000


@pytest.mark.system
@pytest.mark.timeout(400)
def test_a_megatron_learner_splits_its_tensor_parallel_pair_across_two_nodes(
    tmp_path: Path, tiny_model_path: Path, nodes: list[Node]  # noqa: F811 - the fixture
) -> None:
    """TP=2 with one rank per node: every layer's collectives cross the nodes, and each push gathers the shards
    across them (streamed into the engines bucket by bucket)."""
    pytest.importorskip("megatron.core")
    pytest.importorskip("mbridge")
    steps = 4
    run_dir, head, other = start_two_nodes(tmp_path, tiny_model_path, nodes, steps, "--train-backend", "megatron",
                                           "--tensor-model-parallel-size", "2", "--max-staleness", "1")
    finish_both(head, other, run_dir, timeout=360)
    records = [json.loads(line) for line in (run_dir / "metrics" / "train.jsonl").read_text().splitlines()]
    assert max(record["step"] for record in records) == steps
    assert all(math.isfinite(record["loss"]) for record in records)
    learner = log_records(run_dir, "learner")
    pushed = [record["version"] for record in learner if record.get("event") == "weights pushed"]
    assert max(pushed) == steps, "the engines never received the final weights"
    assert any((run_dir / "checkpoints").rglob("trainer_state.json")), "no Megatron checkpoint was written"
    assert "learner rank 1/2 ready" in (run_dir / "logs" / "learner-rank-1.log").read_text()
