"""A learner of several processes: the learner actor is rank 0 and drives the other ranks in lock-step.

Every trainer method is collective, so rank 0 broadcasts each operation, with its inputs, before running it
itself; the followers loop on that broadcast and make the same call on their own trainer. Followers never touch
the bus: a batch reaches them only through rank 0, so the exactly-once accounting (which batch was trained,
which checkpoint covers it) stays in one process.

A learner on several nodes (`--actor-num-nodes N`) is one world of G ranks per node: rank 0 starts the head's
ranks 1..G-1, and on node n the `RemoteLearnerRanks` actor (`remote_ranks.py`) starts ranks nG..nG+G-1, which wait
at rank 0's store (`learner_world_address`, fixed for the run so that they find every incarnation of rank 0).
Rank 0 waits for them with a deadline that names the missing nodes.

Failure: a follower that dies would leave rank 0 blocked in its next collective until a gloo/NCCL timeout. A
watchdog ends rank 0 at once instead: for the head's followers, their exit; for another node's, a heartbeat in
the store that stopped. The launcher restarts the learner, which resumes from its checkpoint with fresh followers
(the head's die with rank 0 through PR_SET_PDEATHSIG; another node's see rank 0's store go, exit, and are started
again by their node's actor). That is the same recovery as a crash of a one-process learner, so the failure
model does not grow a new case.

`python -m actors.learner.ranks --rank R --world W --init-method tcp://HOST:PORT --config FILE` runs a follower.
Rank 0 hosts the world's store on the node's `--host` address only (torch's own would listen on every
interface), and the followers connect to it as clients.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import torch
import torch.distributed as dist

from actors.config import RunConfig
from actors.config.run import learner_ranks_per_node
from actors.learner.stages import data_parallel_shard
from actors.learner.step import PreparedBatch, StepReport, TrainingStep
from actors.learner.trainer_factory import build_trainer
from bus.codec import decode, encode
from bus.schema import Batch
from engines.process import die_with_parent as _die_with_parent
from engines.process import exit_now
from engines.training.base import Trainer, WeightLayout
from engines.training.determinism import use_deterministic_kernels
from engines.weights.group import host_store, interface_of, local_address_towards, missing_keys

STOP = "stop"
COLLECTIVE_TIMEOUT = timedelta(minutes=30)  # a slow checkpoint must not look like a dead rank
REMOTE_JOIN_TIMEOUT_S = 600.0  # rank 0's wait for the other nodes' ranks to reach its store
BEAT_S = 1.0  # every follower counts up its key in rank 0's store this often
SILENT_HEARTBEATS = 20  # another node's rank whose count stood still this many heartbeat intervals is gone: rank 0
SILENT_MIN_S = 20 * BEAT_S  # ends, the learner restarts; never under this many of the followers' own beats
REPO = Path(__file__).resolve().parents[2]
WORLD_KEY = "world"  # in rank 0's store: a token per incarnation of rank 0
Result = TypeVar("Result")


def backend() -> str:
    """NCCL for CUDA tensors and gloo for CPU ones on GPU machines (checkpoint loaders scatter CPU tensors)."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def rank_device(rank: int) -> torch.device | None:
    """Binds an NCCL world to the rank's GPU, so barriers and object collectives know their device."""
    return torch.device("cuda", rank) if torch.cuda.is_available() else None


def bind_device(rank: int) -> None:
    """Learner rank r owns cuda:r of the learner's GPUs (the launcher made exactly those visible); set before any
    collective so NCCL never sees two ranks on one device. LOCAL_RANK is what the trainers read."""
    os.environ["LOCAL_RANK"] = str(rank)
    if torch.cuda.is_available():
        if rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"learner rank {rank} has no GPU: this process sees {torch.cuda.device_count()} "
                "(give the learner one GPU per rank)"
            )
        torch.cuda.set_device(rank)


class LearnerRanks:
    """Rank 0's handle on the followers: start them, broadcast each operation, stop them."""

    def __init__(self, config: RunConfig, run_dir: Path, host: str, log: Any, *,
                 heartbeat_interval: float = 1.0) -> None:
        self.config = config
        self.world = config.trainer.learner_ranks
        self.per_node = learner_ranks_per_node(config)  # the head's ranks: 0 .. per_node - 1
        self.run_dir = run_dir
        self.host = host
        self.log = log
        self.followers: list[subprocess.Popen[bytes]] = []
        self.commands: Any = None  # the gloo group that carries operations (the default group may be NCCL)
        self._lock = threading.Lock()  # one operation at a time, even when a cancelled step still runs
        self._closing = False
        self._init_method = ""
        self._store: dist.TCPStore | None = None
        self.silent_s = silent_after(heartbeat_interval)

    def spawn(self) -> None:
        """Start the followers; from the event loop's thread, because PDEATHSIG follows the spawning thread."""
        if self.world == 1:
            return
        host, port = self.host, 0
        if self.per_node < self.world:  # the other nodes' ranks find every incarnation of rank 0 at one address
            host, port = world_address(self.config)
        self._store = host_store(host, port, COLLECTIVE_TIMEOUT.total_seconds())
        self._init_method = f"tcp://{host}:{self._store.port}"
        self._store.set(WORLD_KEY, secrets.token_hex(8))  # tells another node's ranks which world is up
        config_path = write_rank_config(self.config, self.run_dir / "actors" / "learner-ranks.json")
        self.followers = [start_follower(rank, rank, self.world, self._init_method, config_path, self.run_dir)
                          for rank in range(1, self.per_node)]
        self.log.info("learner ranks started", world=self.world, pids=[p.pid for p in self.followers],
                      other_nodes=self.config.placement.actor_num_nodes - 1)
        threading.Thread(target=self._watch, name="learner-ranks-watchdog", daemon=True).start()

    def join(self) -> None:
        """Blocking: form the world as rank 0 (call in a thread, after `spawn`)."""
        bind_device(0)
        if self.world == 1:
            return
        if self.per_node < self.world:
            use_interface_towards(world_address(self.config)[0])
        self._await_other_nodes()
        dist.init_process_group(backend(), store=self._store, rank=0, world_size=self.world,
                                timeout=COLLECTIVE_TIMEOUT, device_id=rank_device(0))
        self.commands = join_command_group()
        if self.per_node < self.world:
            threading.Thread(target=self._watch_other_nodes, name="learner-ranks-heartbeats", daemon=True).start()

    def _await_other_nodes(self) -> None:
        """Every other node's ranks reached the store, or an error that names the nodes that did not."""
        keys = [f"joined/{rank}" for rank in range(self.per_node, self.world)]
        missing = missing_keys(self._store, keys, REMOTE_JOIN_TIMEOUT_S) if keys else []
        if missing:
            ranks = sorted(int(key.split("/")[1]) for key in missing)
            nodes = sorted({rank // self.per_node for rank in ranks})
            raise RuntimeError(
                f"learner ranks {ranks} (node {', '.join(map(str, nodes))}) did not reach rank 0's store at "
                f"{self._init_method} within {REMOTE_JOIN_TIMEOUT_S:g} s: run `launcher.py --node-rank N` with the "
                "head's address on each of those nodes, and check that they can reach this address")
        if keys:
            self.log.info("learner ranks of the other nodes joined", ranks=f"{self.per_node}-{self.world - 1}")

    def run(self, operation: str, payload: Any, local: Callable[[], Result]) -> Result:
        """Tell the followers to do `operation` with `payload`, then do it here (`local`); blocking."""
        with self._lock:
            if self.world > 1:
                dist.broadcast_object_list([(operation, payload)], src=0, group=self.commands)
            return local()

    def run_scattered(self, operation: str, payloads: list[Any], local: Callable[[], Result]) -> Result:
        """Like `run`, but follower r receives only `payloads[r]` (rank 0's own share is `payloads[0]`)."""
        if len(payloads) != self.world:
            raise ValueError(f"{operation}: {len(payloads)} payloads for a world of {self.world} ranks")
        with self._lock:
            if self.world > 1:
                dist.broadcast_object_list([(operation, None)], src=0, group=self.commands)
                dist.scatter_object_list([None], payloads, src=0, group=self.commands)
            return local()

    def close(self) -> None:
        if self.world == 1 or self._closing:
            return
        self._closing = True
        if dist.is_initialized():
            try:
                self.run(STOP, None, lambda: None)
            except Exception as error:  # followers already gone: nothing left to tell
                self.log.warning("could not stop learner ranks cleanly", error=repr(error))
        deadline = time.monotonic() + 30
        for follower in self.followers:
            try:
                follower.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                follower.kill()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _watch_other_nodes(self) -> None:
        """Another node's rank that died, or whose node is cut off, leaves rank 0 in a collective until its
        timeout: its heartbeat count standing still for `silent_s` ends rank 0 instead (a restart, as above)."""
        store = store_client(self._init_method, timedelta(seconds=30))
        counts: dict[int, int] = {}
        heard = dict.fromkeys(range(self.per_node, self.world), time.monotonic())
        while not self._closing:
            now = time.monotonic()
            for rank in heard:
                try:
                    count = store.add(f"beat/{rank}", 0)
                except (RuntimeError, dist.DistError) as error:  # our own store: a hiccup; silence still counts
                    self.log.warning("could not read a learner rank's heartbeat", rank=rank, error=str(error))
                    count = counts.get(rank, 0)
                if count != counts.get(rank):
                    counts[rank], heard[rank] = count, now
                elif now - heard[rank] > self.silent_s and not self._closing:
                    self.log.error("a learner rank on another node fell silent; ending the learner so the run "
                                   "resumes from its checkpoint", rank=rank, node=rank // self.per_node,
                                   silent_s=round(now - heard[rank], 1))
                    os._exit(1)
            time.sleep(BEAT_S)

    def _watch(self) -> None:
        while not self._closing:
            for rank, follower in enumerate(self.followers, start=1):
                code = follower.poll()
                if code is not None and not self._closing:
                    self.log.error("learner rank died; ending the learner so the run resumes from its checkpoint",
                                   rank=rank, code=code)
                    os._exit(1)
            time.sleep(0.5)


def silent_after(heartbeat_interval: float) -> float:
    """How long another node's rank may stay silent: 20 of the run's heartbeat intervals, and never less than 20 of
    the followers' own beats. A follower's beat can stand still for seconds that are no hang: on a loaded machine,
    while it builds its model or waits for rank 0 in a group's set-up. With a 5 s floor, both two-node system tests
    restarted their worlds until their deadlines on a busy CI machine."""
    return max(SILENT_MIN_S, SILENT_HEARTBEATS * heartbeat_interval)


def join_command_group() -> Any:
    """Operations travel as pickled objects, which NCCL cannot carry: a gloo group beside an NCCL world."""
    return dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None


class CollectiveTrainer:
    """Rank 0's trainer as the learner sees it: each call that touches the model runs on every rank."""

    def __init__(self, local: Trainer, ranks: LearnerRanks) -> None:
        self.local = local
        self.ranks = ranks

    @property
    def version(self) -> int:
        return self.local.version

    def train(self, step: TrainingStep, batch: Batch, prepared: PreparedBatch | None = None) -> StepReport:
        """A data-parallel trainer's follower receives only its share of the batch, cut here at rank 0; one that
        shards itself (Megatron) gets the whole batch. Rank 0 trains its share of the whole batch, whose rollout
        metrics it reports. `prepared` (one rank only) is the batch already through `TrainingStep.prepare`."""
        rollout_id = batch.batch_id - 1  # slime's 0-based rollout id names the step (profiler, train-data dump)
        if prepared is not None:
            if self.ranks.world > 1:
                raise ValueError("a prepared batch is for a one-rank learner; followers would not have it")
            return self.ranks.run("train", None, lambda: step.train_prepared(prepared, rollout_id=rollout_id))
        parallel = self.local.data_parallel()
        if parallel.size == 1 or parallel.size != self.ranks.world:
            frame = encode(batch) if self.ranks.world > 1 else None  # the followers' copy; one rank has none
            return self.ranks.run("train", frame, lambda: step.train(batch.samples, batch.staleness,
                                                                     rollout_id=rollout_id))
        shares = [encode(share) for share in data_parallel_shares(batch, parallel.size)]
        return self.ranks.run_scattered("train_share", shares, lambda: step.train(batch.samples, batch.staleness,
                                                                                  rollout_id=rollout_id))

    def save_checkpoint(self, directory: str | Path, extra_state: dict[str, Any]) -> None:
        self.ranks.run("save_checkpoint", (str(directory), extra_state),
                       lambda: self.local.save_checkpoint(directory, extra_state))

    def load_checkpoint(self, directory: str | Path) -> dict[str, Any]:
        return self.ranks.run("load_checkpoint", str(directory), lambda: self.local.load_checkpoint(directory))

    def named_tensors(self, layout: WeightLayout = "model") -> Iterator[tuple[str, torch.Tensor]]:
        """Rank 0's tensors one at a time, as the consumer asks, with no list of them kept here.

        Gathering shards is collective, so the followers iterate alongside, and the ranks' lock is held until
        the end so no other operation interleaves. Closed early (a transfer that failed), it still runs the
        iteration to its end: the followers are inside the same collectives and must reach it too.

        One rank whose trainer gates its updates is read without the lock: a push reads while the next step runs,
        and the step's write waits for the read (`Trainer.update_gate`) instead.
        """
        if self.ranks.world == 1 and self.local.gates_updates:
            yield from self.local.named_tensors(layout)
            return
        with self.ranks._lock:
            if self.ranks.world > 1:
                dist.broadcast_object_list([("named_tensors", layout)], src=0, group=self.ranks.commands)
            tensors = self.local.named_tensors(layout)
            try:
                # Not `yield from`, which would close `tensors` on our close, before the finally can drain it.
                for item in tensors:  # noqa: UP028
                    yield item
            finally:
                if self.ranks.world > 1:
                    for _ in tensors:
                        pass

    def export_hf(self, directory: str | Path) -> None:
        self.ranks.run("export_hf", str(directory), lambda: self.local.export_hf(directory))

    def close(self) -> None:
        self.local.close()  # drops DDP state first: it must not outlive the process group
        self.ranks.close()


def data_parallel_shares(batch: Batch, size: int) -> list[Batch]:
    """The batch cut into each data-parallel rank's share, by the same rule every rank's step applies."""
    lengths = [int(s.response_length) for s in batch.samples]
    group_ids = [s.group_id for s in batch.samples]
    shares = []
    for rank in range(size):
        mine = data_parallel_shard(group_ids, lengths, rank=rank, size=size)
        shares.append(msgspec.structs.replace(batch, samples=[batch.samples[i] for i in mine],
                                              staleness=[batch.staleness[i] for i in mine] if batch.staleness else []))
    return shares


def world_address(config: RunConfig) -> tuple[str, int]:
    address = config.placement.learner_world_address
    if address is None:
        raise ValueError("a learner on several nodes needs learner_world_address (the head's launcher sets it)")
    parts = urllib.parse.urlsplit(address)
    return parts.hostname or "", parts.port or 0


def use_interface_towards(rank_zero_host: str) -> None:
    """Gloo of a world spanning nodes listens on this node's address on the route to rank 0 (GLOO_SOCKET_IFNAME,
    unless the user set it): its default, found from the hostname, may be an address other nodes cannot reach."""
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        name = interface_of(local_address_towards(rank_zero_host))
        if name is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = name


def store_client(init_method: str, timeout: timedelta) -> dist.TCPStore:
    """A client of rank 0's store at `init_method` (tcp://HOST:PORT); waits up to `timeout` for it to be up."""
    address = urllib.parse.urlsplit(init_method)
    return dist.TCPStore(address.hostname or "", address.port or 0, is_master=False, timeout=timeout)


def write_rank_config(config: RunConfig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config.model_dump(mode="json")), encoding="utf-8")
    return path


def start_follower(rank: int, local_rank: int, world: int, init_method: str, config_path: Path,
                   run_dir: Path) -> subprocess.Popen[bytes]:
    """One follower process, logging to RUN_DIR/logs/learner-rank-R.log; it dies with the thread that starts it."""
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / f"learner-rank-{rank}.log", "ab") as output:
        return subprocess.Popen(
            [sys.executable, "-m", "actors.learner.ranks", "--rank", str(rank), "--local-rank", str(local_rank),
             "--world", str(world), "--init-method", init_method, "--config", str(config_path)],
            stdout=output, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent, cwd=REPO,
        )


def _beat(init_method: str, rank: int, stopping: threading.Event) -> None:
    """A follower's heartbeat in rank 0's store; when the store is gone, so is rank 0: exit, even from inside a
    collective that would otherwise wait for its timeout (unless rank 0 said stop: then it is going on purpose)."""
    try:
        store = store_client(init_method, timedelta(seconds=30))
        while not stopping.wait(BEAT_S):
            store.add(f"beat/{rank}", 1)
    except (RuntimeError, dist.DistError) as error:
        if stopping.is_set():
            return
        print(f"learner rank {rank}: rank 0's store at {init_method} is gone ({error}); exiting", flush=True)
        os._exit(1)


def follow(rank: int, world: int, init_method: str, config: RunConfig, local_rank: int | None = None) -> None:
    """A follower's whole life: join the world, build the same trainer, mirror rank 0's operations. `local_rank`
    (default: `rank`) is its index among its node's learner ranks, which picks its GPU."""
    torch.set_num_threads(config.torch_threads)
    if config.megatron.deterministic_mode:
        use_deterministic_kernels()
    local_rank = rank if local_rank is None else local_rank
    bind_device(local_rank)
    if learner_ranks_per_node(config) < world:
        use_interface_towards(urllib.parse.urlsplit(init_method).hostname or "")
    store = store_client(init_method, COLLECTIVE_TIMEOUT)
    store.set(f"joined/{rank}", b"1")
    stopping = threading.Event()
    threading.Thread(target=_beat, args=(init_method, rank, stopping), name="learner-rank-heartbeat",
                     daemon=True).start()
    # A store given (not an init method) on both ends: torch prefixes the keys of a store it makes, not of ours.
    dist.init_process_group(backend(), store=store, rank=rank, world_size=world,
                            timeout=COLLECTIVE_TIMEOUT, device_id=rank_device(local_rank))
    commands = join_command_group()
    trainer = build_trainer(config)
    step = TrainingStep(trainer, config)
    parallel = trainer.data_parallel()  # ranks that share samples (tensor or context parallel) say where they sit
    shares = "" if parallel.size == world else f", data-parallel rank {parallel.rank}/{parallel.size}"
    print(f"learner rank {rank}/{world} ready{shares}", flush=True)
    try:
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=commands)
            operation, payload = box[0]
            if operation == STOP:
                stopping.set()
                break
            if operation == "train":
                batch = decode(payload)
                step.train(batch.samples, batch.staleness, rollout_id=batch.batch_id - 1)
            elif operation == "train_share":
                box = [None]
                dist.scatter_object_list(box, None, src=0, group=commands)
                share = decode(box[0])
                step.train(share.samples, share.staleness, shard=False, rollout_id=share.batch_id - 1)
            elif operation == "save_checkpoint":
                trainer.save_checkpoint(payload[0], payload[1])
            elif operation == "load_checkpoint":
                trainer.load_checkpoint(payload)
            elif operation == "named_tensors":
                for _ in trainer.named_tensors(payload):
                    pass
            elif operation == "export_hf":
                trainer.export_hf(payload)
            else:
                raise ValueError(f"learner rank {rank}: unknown operation {operation!r} from rank 0")
    finally:
        if step.profiler is not None:
            step.profiler.close()
        trainer.close()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A follower rank of a multi-process learner (started by rank 0).")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--local-rank", type=int, help="its index among its node's learner ranks (default: --rank)")
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--config", type=Path, required=True)
    args = parser.parse_args(argv)
    config = RunConfig(**json.loads(args.config.read_text(encoding="utf-8")))
    follow(args.rank, args.world, args.init_method, config, args.local_rank)
    exit_now(0)  # rank 0's stop waits for this process to end, not for torch's modules to be torn down


if __name__ == "__main__":
    main()
