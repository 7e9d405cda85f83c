"""The same `launcher.py` command on several nodes, each placed by its scheduler's environment alone
(docs/cluster.md): the variables `srun` sets, or a torchrun-style job's with a rendezvous file.

Each "node" is a launcher process on this machine with its own loopback address (127.0.0.1, .2, .3: Linux routes
all of 127/8 to the loopback interface), so every node binds and advertises an address of its own, as on a
cluster, and a short RL job runs across them.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tools.make_arithmetic_data import make_arithmetic_data

REPO = Path(__file__).resolve().parents[2]
STEPS = 12
SCHEDULER_VARIABLES = ("SLURM_", "SLURMD_", "MASTER_", "NODE_RANK", "GROUP_RANK", "RANK", "NNODES", "WORLD_SIZE",
                       "LWS_", "JOB_COMPLETION_INDEX")


def job_command(run_dir: Path, model: Path, data: Path) -> list[str]:
    """What every node runs: no --head, no --head-address, no --node-rank, no --host."""
    return [sys.executable, str(REPO / "launcher.py"), "--run-dir", str(run_dir), "--hf-checkpoint", str(model),
            "--prompt-data", str(data), "--num-rollout", str(STEPS), "--rollout-batch-size", "4",
            "--n-samples-per-prompt", "2", "--rollout-max-response-len", "8", "--max-staleness", "2",
            "--rollout-workers", "1", "--reward-workers", "1", "--torch-threads", "1", "--heartbeat-interval", "0.5",
            "--connect-timeout", "60", "--final-eval-timeout", "0", "--no-progress", "--no-use-tensorboard",
            "--no-plots"]


def node_env(variables: dict[str, str]) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith(SCHEDULER_VARIABLES)}
    return {**env, **variables}


def run_nodes(command: list[str], envs: list[dict[str, str]]) -> list[subprocess.CompletedProcess[str]]:
    nodes = [subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for env in envs]
    finished = []
    try:
        for node in nodes:
            output, _ = node.communicate(timeout=240)
            finished.append(subprocess.CompletedProcess(command, node.returncode, output, ""))
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    return finished


def events(run_dir: Path, actor: str, event: str) -> list[dict]:
    lines = (run_dir / "logs" / f"{actor}.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, filter(str.strip, lines)) if record.get("event") == event]


def free_port_below_40000() -> int:
    """A free port a Slurm job id can name (`20000 + id % 20000`)."""
    for port in range(24000 + os.getpid() % 8000, 40000):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 24000-39999")


@pytest.mark.system
@pytest.mark.timeout(300)
def test_srun_on_three_nodes_needs_no_per_node_flags(tmp_path: Path, tiny_model_path: Path) -> None:
    data = make_arithmetic_data(tmp_path / "data", max_operand=9, eval_size=10)["train"]
    run_dir = tmp_path / "run"
    job = free_port_below_40000() - 20000  # so the head's derived port is free
    slurm = {"SLURM_JOB_ID": str(job), "SLURM_JOB_NODELIST": "127.0.0.[1-3]", "SLURM_NNODES": "3",
             "SLURM_TASKS_PER_NODE": "1(x3)", "SLURM_LOCALID": "0"}
    envs = [node_env({**slurm, "SLURM_NODEID": str(rank), "SLURM_PROCID": str(rank),
                      "SLURMD_NODENAME": f"127.0.0.{rank + 1}"}) for rank in range(3)]
    finished = run_nodes(job_command(run_dir, tiny_model_path, data), envs)
    for rank, node in enumerate(finished):
        assert node.returncode == 0, f"node {rank}:\n{node.stdout[-3000:]}"
        assert f"slurm: node {rank} of 3, head 127.0.0.1:{20000 + job}" in node.stdout

    steps = [json.loads(line)["step"] for line in (run_dir / "metrics" / "train.jsonl").read_text().splitlines()]
    assert max(steps) == STEPS
    (listening,) = events(run_dir, "controller", "controller listening")
    assert listening["expected"] == {"buffer": 1, "learner": 1, "reward": 3, "rollout": 3}  # every node's workers
    for rank in range(3):
        # each node's actors bind their node's own address, and work crosses the nodes
        (started,) = events(run_dir, f"reward-{rank}-0", "actor started")
        assert started["endpoints"]["inbox"].startswith(f"tcp://127.0.0.{rank + 1}:"), started
        (stopped,) = events(run_dir, f"reward-{rank}-0", "actor stopped")
        assert stopped["counters"]["samples.scored"] > 0, f"node {rank}'s reward worker scored nothing"
    assert (run_dir / "config.yaml").exists()
    assert {path.name for path in run_dir.glob("config-node*.yaml")} == {"config-node1.yaml", "config-node2.yaml"}


@pytest.mark.system
@pytest.mark.timeout(300)
def test_a_torchrun_style_job_finds_its_head_through_a_rendezvous_file(tmp_path: Path, tiny_model_path: Path) -> None:
    data = make_arithmetic_data(tmp_path / "data", max_operand=9, eval_size=10)["train"]
    run_dir, rendezvous = tmp_path / "run", tmp_path / "shared" / "head-address"
    command = [*job_command(run_dir, tiny_model_path, data), "--rendezvous-file", str(rendezvous)]
    envs = [node_env({"MASTER_ADDR": "127.0.0.1", "NODE_RANK": str(rank), "NNODES": "2"}) for rank in range(2)]
    finished = run_nodes(command, envs)
    for rank, node in enumerate(finished):
        assert node.returncode == 0, f"node {rank}:\n{node.stdout[-3000:]}"
    head_address = rendezvous.read_text().splitlines()[0]
    (registered,) = events(run_dir, "reward-1-0", "registered")
    assert registered["head"] == head_address
    (stopped,) = events(run_dir, "reward-1-0", "actor stopped")
    assert stopped["counters"]["samples.scored"] > 0
