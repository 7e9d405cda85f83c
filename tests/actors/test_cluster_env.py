"""A node's place in a multi-node job, from what Slurm, LeaderWorkerSet or a torchrun-style job set in its
environment (`actors/launch/cluster_env.py`)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from actors.launch.cluster_env import (
    ClusterEnvError,
    ClusterNode,
    detect,
    expand_nodelist,
    read_rendezvous,
    routable_address,
    write_rendezvous,
)

pytestmark = pytest.mark.unit
SLURM = {"SLURM_JOB_ID": "81234", "SLURM_JOB_NODELIST": "gpu[07-09]", "SLURM_NNODES": "3", "SLURM_NODEID": "2",
         "SLURM_PROCID": "2", "SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "1(x3)", "SLURMD_NODENAME": "gpu09"}


def test_slurm_names_the_node_its_head_and_a_port_of_the_job() -> None:
    node = detect(SLURM)
    assert node == ClusterNode("slurm", 2, 3, "gpu07", 20000 + 81234 % 20000, "gpu09")
    assert not node.is_head and detect({**SLURM, "SLURM_NODEID": "0"}).is_head
    assert detect({**SLURM, "MASTER_PORT": "31000"}).head_port == 31000
    # a step's own node list is the one its tasks run on
    assert detect({**SLURM, "SLURM_STEP_NODELIST": "cpu[1-2]"}).head_host == "cpu1"


def test_several_launchers_per_slurm_node_are_refused_with_the_fix() -> None:
    with pytest.raises(ClusterEnvError, match=r"run one launcher per node: srun --ntasks-per-node=1"):
        detect({**SLURM, "SLURM_TASKS_PER_NODE": "4(x3)", "SLURM_LOCALID": "0"})
    with pytest.raises(ClusterEnvError, match="SLURM_TASKS_PER_NODE"):
        detect({**SLURM, "SLURM_TASKS_PER_NODE": "2", "SLURM_LOCALID": "1"})


def test_kubernetes_and_torchrun_style_jobs() -> None:
    leader = {"LWS_LEADER_ADDRESS": "rl-0.rl.default", "LWS_WORKER_INDEX": "1", "LWS_GROUP_SIZE": "4"}
    assert detect(leader) == ClusterNode("leaderworkerset", 1, 4, "rl-0.rl.default", 29700)
    indexed = {"MASTER_ADDR": "rl-head", "MASTER_PORT": "29900", "JOB_COMPLETION_INDEX": "3"}
    assert detect(indexed) == ClusterNode("torchrun-style (JOB_COMPLETION_INDEX)", 3, None, "rl-head", 29900)
    assert detect({"MASTER_ADDR": "h", "NODE_RANK": "1", "RANK": "9", "NNODES": "2"}).rank == 1
    assert detect({}) is None and detect({"MASTER_ADDR": "h"}) is None  # an address alone says no rank
    with pytest.raises(ClusterEnvError, match=r"NODE_RANK='one' is not an integer"):
        detect({"MASTER_ADDR": "h", "NODE_RANK": "one"})


def test_slurm_host_lists_expand_as_scontrol_show_hostnames_does() -> None:
    assert expand_nodelist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_nodelist("n[8-10]-ib") == ["n8-ib", "n9-ib", "n10-ib"]
    assert expand_nodelist("127.0.0.[1-3]") == ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    with pytest.raises(ClusterEnvError, match="'a-b' is not a number or a range"):
        expand_nodelist("gpu[a-b]")


def test_a_node_binds_the_address_its_name_resolves_to_else_the_route_to_the_head() -> None:
    assert routable_address("127.0.0.3", "127.0.0.1", 29700) == "127.0.0.3"
    assert routable_address(None, "127.0.0.1", 29700) == "127.0.0.1"


def test_rendezvous_file_gives_the_heads_address_to_its_own_job_only(tmp_path: Path) -> None:
    path = tmp_path / "shared" / "head"
    write_rendezvous(path, "tcp://10.0.0.5:41000", key="111")  # left over by an earlier job
    later = threading.Timer(0.3, write_rendezvous, args=(path, "tcp://10.0.0.6:42000", "222"))
    later.start()
    started = time.monotonic()
    assert read_rendezvous(path, "222", timeout=10) == "tcp://10.0.0.6:42000"
    assert time.monotonic() - started >= 0.25
    with pytest.raises(TimeoutError, match=r"--rendezvous-file .*head: the head wrote no address for job 333"):
        read_rendezvous(path, "333", timeout=0.3)
