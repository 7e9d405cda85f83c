"""Where this node stands in a multi-node job, read from the scheduler that started it.

`srun python launcher.py ...` on N nodes, or the same command in every pod of a Kubernetes job, must need no
per-node flags: the first node is the head, the others join it. Each scheduler says so in its own variables:

* Slurm (`srun`, one task per node): the rank is `SLURM_NODEID` (else `SLURM_PROCID`), the head the first host
  of `SLURM_STEP_NODELIST` (else `SLURM_JOB_NODELIST`), this node `SLURMD_NODENAME`.
* LeaderWorkerSet: the rank is `LWS_WORKER_INDEX`, the head `LWS_LEADER_ADDRESS`.
* torchrun-style (PyTorchJob, JobSet, an indexed Job): the rank is the first of `NODE_RANK`, `GROUP_RANK`,
  `JOB_COMPLETION_INDEX` and `RANK` that is set, the head `MASTER_ADDR`.

The head's port is `MASTER_PORT` where the environment has one. Otherwise a Slurm job derives it from its job id
(`20000 + id % 20000`), so two jobs sharing a head node do not collide, and the others use `DEFAULT_HEAD_PORT`.
A rendezvous file on a shared filesystem (`--rendezvous-file`) replaces the port agreement: the head writes the
address it bound (with the Slurm job id, so a file left by an earlier job is not read), and the other nodes read
it. Outside Slurm, give each job a fresh file.

Explicit `--head` / `--head-address` flags always win: this module is consulted only when neither is given.
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

DEFAULT_HEAD_PORT = 29700
RENDEZVOUS_POLL_S = 0.2


class ClusterEnvError(ValueError):
    """The scheduler's variables do not describe one launcher per node; the message names the variable."""


@dataclass(frozen=True)
class ClusterNode:
    """This node's place in the job: `rank` 0 is the head."""

    scheduler: str
    rank: int
    nodes: int | None  # how many nodes the job has, where the scheduler says
    head_host: str
    head_port: int
    own_host: str | None = None  # this node's name as the scheduler gives it (Slurm), for the address to bind

    @property
    def is_head(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        of = f" of {self.nodes}" if self.nodes is not None else ""
        return f"{self.scheduler}: node {self.rank}{of}, head {self.head_host}:{self.head_port}"


def detect(env: Mapping[str, str] | None = None) -> ClusterNode | None:
    """This node's place from `env` (default: the process environment), or None when no scheduler started it."""
    env = os.environ if env is None else env
    if "SLURM_JOB_ID" in env and ("SLURM_STEP_NODELIST" in env or "SLURM_JOB_NODELIST" in env):
        return _slurm(env)
    if "LWS_LEADER_ADDRESS" in env:
        return ClusterNode("leaderworkerset", _int(env, "LWS_WORKER_INDEX", default=0),
                           _optional_int(env, "LWS_GROUP_SIZE"), env["LWS_LEADER_ADDRESS"],
                           _port(env, DEFAULT_HEAD_PORT))
    if "MASTER_ADDR" in env:
        for name in ("NODE_RANK", "GROUP_RANK", "JOB_COMPLETION_INDEX", "RANK"):
            if name in env:
                nodes = _optional_int(env, "NNODES") or _optional_int(env, "WORLD_SIZE")
                return ClusterNode(f"torchrun-style ({name})", _int(env, name), nodes, env["MASTER_ADDR"],
                                   _port(env, DEFAULT_HEAD_PORT))
    return None


def _slurm(env: Mapping[str, str]) -> ClusterNode:
    tasks_here = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "1")
    if _int(env, "SLURM_LOCALID", default=0) != 0 or not re.fullmatch(r"1(\(x\d+\))?", tasks_here.split(",")[0]):
        raise ClusterEnvError(f"Slurm started {tasks_here} tasks on this node (SLURM_TASKS_PER_NODE); run one "
                              "launcher per node: srun --ntasks-per-node=1 python launcher.py ...")
    nodelist = env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"]
    hosts = expand_nodelist(nodelist)
    job = _int(env, "SLURM_JOB_ID")
    rank = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else _int(env, "SLURM_PROCID", default=0)
    nodes = _optional_int(env, "SLURM_NNODES") or _optional_int(env, "SLURM_JOB_NUM_NODES") or len(hosts)
    return ClusterNode("slurm", rank, nodes, hosts[0], _port(env, 20000 + job % 20000), env.get("SLURMD_NODENAME"))


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compressed host list -> host names: `gpu[01-03,07],login1` -> gpu01 gpu02 gpu03 gpu07 login1."""
    hosts: list[str] = []
    for match in re.finditer(r"([^,\[]+)(?:\[([^\]]*)\])?([^,]*)", text):
        prefix, ranges, suffix = match.group(1), match.group(2), match.group(3)
        if ranges is None:
            hosts.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            low, _, high = part.partition("-")
            if not low.isdigit() or (high and not high.isdigit()):
                raise ClusterEnvError(f"SLURM_JOB_NODELIST {text!r}: {part!r} is not a number or a range")
            for number in range(int(low), int(high or low) + 1):
                hosts.append(f"{prefix}{number:0{len(low)}d}{suffix}")
    if not hosts:
        raise ClusterEnvError(f"SLURM_JOB_NODELIST {text!r} names no host")
    return hosts


def routable_address(host: str | None, head_host: str, head_port: int) -> str:
    """The address this node's actors bind and advertise: its scheduler-given name resolved, else the address of
    the interface that routes to the head (no packet is sent: a UDP socket's connect only picks the route)."""
    if host:
        return socket.gethostbyname(host)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((socket.gethostbyname(head_host), head_port))
            return probe.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def job_key(env: Mapping[str, str] | None = None) -> str:
    """What tells this job's rendezvous file from an earlier job's: the Slurm job id, where there is one."""
    env = os.environ if env is None else env
    return env.get("SLURM_JOB_ID", "")


def write_rendezvous(path: Path, address: str, key: str) -> None:
    """The head's address for the other nodes, written whole (a reader never sees half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(f"{address}\n{key}\n", encoding="utf-8")
    partial.replace(path)


def read_rendezvous(path: Path, key: str, timeout: float) -> str:
    """The head's address from `path`, once this job's head wrote it (a file another job's head wrote, with
    another key, is waited past); TimeoutError names the file after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            address, _, written_key = path.read_text(encoding="utf-8").partition("\n")
            if address.strip() and written_key.strip() == key:
                return address.strip()
        except FileNotFoundError:
            pass
        if time.monotonic() >= deadline:
            raise TimeoutError(f"--rendezvous-file {path}: the head wrote no address"
                               f"{f' for job {key}' if key else ''} within {timeout:.0f}s")
        time.sleep(RENDEZVOUS_POLL_S)


def _port(env: Mapping[str, str], default: int) -> int:
    port = _optional_int(env, "MASTER_PORT")
    return default if port is None else port


def _int(env: Mapping[str, str], name: str, *, default: int | None = None) -> int:
    value = env.get(name)
    if value is None:
        if default is None:
            raise ClusterEnvError(f"{name} is not set")
        return default
    try:
        number = int(value)
    except ValueError:
        raise ClusterEnvError(f"{name}={value!r} is not an integer") from None
    if number < 0:
        raise ClusterEnvError(f"{name}={value!r} is negative")
    return number


def _optional_int(env: Mapping[str, str], name: str) -> int | None:
    return _int(env, name) if name in env else None
