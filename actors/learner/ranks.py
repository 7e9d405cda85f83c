"""A learner of several processes: the learner actor is rank 0 and drives the other ranks in lock-step.

Every trainer method is collective, so rank 0 broadcasts each operation, with its inputs, before running it
itself; the followers loop on that broadcast and make the same call on their own trainer. Followers never touch
the bus: a batch reaches them only through rank 0, so the exactly-once accounting (which batch was trained,
which checkpoint covers it) stays in one process.

Failure: a follower that dies would leave rank 0 blocked in its next collective until a gloo/NCCL timeout. A
watchdog ends rank 0 at once instead; the launcher restarts the learner, which resumes from its checkpoint with
fresh followers (the old ones die with rank 0 through PR_SET_PDEATHSIG). That is the same recovery as a crash
of a one-process learner, so the failure model does not grow a new case.

`python -m actors.learner.ranks --rank R --world W --init-method tcp://HOST:PORT --config FILE` runs a follower;
only rank 0 starts them. Rank 0 hosts the world's store on the node's `--host` address only (torch's own would
listen on every interface), and the followers connect to it as clients.
"""

from __future__ import annotations

import argparse
import json
import os
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
from actors.learner.stages import data_parallel_shard
from actors.learner.step import PreparedBatch, StepReport, TrainingStep
from actors.learner.trainer_factory import build_trainer
from bus.codec import decode, encode
from bus.schema import Batch
from engines.process import die_with_parent as _die_with_parent
from engines.training.base import Trainer
from engines.training.determinism import use_deterministic_kernels
from engines.weights.group import host_store

STOP = "stop"
COLLECTIVE_TIMEOUT = timedelta(minutes=30)  # a slow checkpoint must not look like a dead rank
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

    def __init__(self, config: RunConfig, run_dir: Path, host: str, log: Any) -> None:
        self.config = config
        self.world = config.trainer.learner_ranks
        self.run_dir = run_dir
        self.host = host
        self.log = log
        self.followers: list[subprocess.Popen[bytes]] = []
        self.commands: Any = None  # the gloo group that carries operations (the default group may be NCCL)
        self._lock = threading.Lock()  # one operation at a time, even when a cancelled step still runs
        self._closing = False
        self._init_method = ""
        self._store: dist.TCPStore | None = None

    def spawn(self) -> None:
        """Start the followers; from the event loop's thread, because PDEATHSIG follows the spawning thread."""
        if self.world == 1:
            return
        self._store = host_store(self.host, 0, COLLECTIVE_TIMEOUT.total_seconds())
        self._init_method = f"tcp://{self.host}:{self._store.port}"
        config_path = self.run_dir / "actors" / "learner-ranks.json"
        config_path.parent.mkdir(parents=True, exist_ok=True)
        config_path.write_text(json.dumps(self.config.model_dump(mode="json")), encoding="utf-8")
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for rank in range(1, self.world):
            with open(logs / f"learner-rank-{rank}.log", "ab") as output:
                self.followers.append(subprocess.Popen(
                    [sys.executable, "-m", "actors.learner.ranks", "--rank", str(rank), "--world", str(self.world),
                     "--init-method", self._init_method, "--config", str(config_path)],
                    stdout=output, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent,
                    cwd=Path(__file__).resolve().parents[2],
                ))
        self.log.info("learner ranks started", world=self.world, pids=[p.pid for p in self.followers])
        threading.Thread(target=self._watch, name="learner-ranks-watchdog", daemon=True).start()

    def join(self) -> None:
        """Blocking: form the world as rank 0 (call in a thread, after `spawn`)."""
        bind_device(0)
        if self.world == 1:
            return
        dist.init_process_group(backend(), store=self._store, rank=0, world_size=self.world,
                                timeout=COLLECTIVE_TIMEOUT, device_id=rank_device(0))
        self.commands = join_command_group()

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

    def _watch(self) -> None:
        while not self._closing:
            for rank, follower in enumerate(self.followers, start=1):
                code = follower.poll()
                if code is not None and not self._closing:
                    self.log.error("learner rank died; ending the learner so the run resumes from its checkpoint",
                                   rank=rank, code=code)
                    os._exit(1)
            time.sleep(0.5)


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
        if prepared is not None:
            if self.ranks.world > 1:
                raise ValueError("a prepared batch is for a one-rank learner; followers would not have it")
            return self.ranks.run("train", None, lambda: step.train_prepared(prepared))
        parallel = self.local.data_parallel()
        if parallel.size == 1 or parallel.size != self.ranks.world:
            return self.ranks.run("train", encode(batch), lambda: step.train(batch.samples, batch.staleness))
        shares = [encode(share) for share in data_parallel_shares(batch, parallel.size)]
        return self.ranks.run_scattered("train_share", shares, lambda: step.train(batch.samples, batch.staleness))

    def save_checkpoint(self, directory: str | Path, extra_state: dict[str, Any]) -> None:
        self.ranks.run("save_checkpoint", (str(directory), extra_state),
                       lambda: self.local.save_checkpoint(directory, extra_state))

    def load_checkpoint(self, directory: str | Path) -> dict[str, Any]:
        return self.ranks.run("load_checkpoint", str(directory), lambda: self.local.load_checkpoint(directory))

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Rank 0's tensors one at a time, as the consumer asks, with no list of them kept here.

        Gathering shards is collective, so the followers iterate alongside, and the ranks' lock is held until
        the end so no other operation interleaves. Closed early (a transfer that failed), it still runs the
        iteration to its end: the followers are inside the same collectives and must reach it too.

        One rank whose trainer gates its updates is read without the lock: a push reads while the next step runs,
        and the step's write waits for the read (`Trainer.update_gate`) instead.
        """
        if self.ranks.world == 1 and self.local.gates_updates:
            yield from self.local.named_tensors()
            return
        with self.ranks._lock:
            if self.ranks.world > 1:
                dist.broadcast_object_list([("named_tensors", None)], src=0, group=self.ranks.commands)
            tensors = self.local.named_tensors()
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


def follow(rank: int, world: int, init_method: str, config: RunConfig) -> None:
    """A follower's whole life: join the world, build the same trainer, mirror rank 0's operations."""
    torch.set_num_threads(config.torch_threads)
    if config.megatron.deterministic_mode:
        use_deterministic_kernels()
    bind_device(rank)
    address = urllib.parse.urlsplit(init_method)  # tcp://HOST:PORT, rank 0's store
    store = dist.TCPStore(address.hostname or "", address.port or 0, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    # A store given (not an init method) on both ends: torch prefixes the keys of a store it makes, not of ours.
    dist.init_process_group(backend(), store=store, rank=rank, world_size=world,
                            timeout=COLLECTIVE_TIMEOUT, device_id=rank_device(rank))
    commands = join_command_group()
    trainer = build_trainer(config)
    step = TrainingStep(trainer, config)
    print(f"learner rank {rank}/{world} ready", flush=True)
    try:
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=commands)
            operation, payload = box[0]
            if operation == STOP:
                break
            if operation == "train":
                batch = decode(payload)
                step.train(batch.samples, batch.staleness)
            elif operation == "train_share":
                box = [None]
                dist.scatter_object_list(box, None, src=0, group=commands)
                share = decode(box[0])
                step.train(share.samples, share.staleness, shard=False)
            elif operation == "save_checkpoint":
                trainer.save_checkpoint(payload[0], payload[1])
            elif operation == "load_checkpoint":
                trainer.load_checkpoint(payload)
            elif operation == "named_tensors":
                for _ in trainer.named_tensors():
                    pass
            elif operation == "export_hf":
                trainer.export_hf(payload)
            else:
                raise ValueError(f"learner rank {rank}: unknown operation {operation!r} from rank 0")
    finally:
        trainer.close()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A follower rank of a multi-process learner (started by rank 0).")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--config", type=Path, required=True)
    args = parser.parse_args(argv)
    config = RunConfig(**json.loads(args.config.read_text(encoding="utf-8")))
    follow(args.rank, args.world, args.init_method, config)


if __name__ == "__main__":
    main()
