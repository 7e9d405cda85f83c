"""Benchmark: weight transfer to 1 and N receivers against one raw torch.distributed broadcast of the same bytes.

    python -m tools.bench.weights                 # ~270M-parameter synthetic transformer, fp32 and bf16, 1 and 3
    python -m tools.bench.weights --quick         # a few MB, for the smoke test
    python -m tools.bench.weights --json out.json
    python -m tools.bench.weights --backends gloo # the broadcast alone (default: gloo and shm)

The state dict is shaped like a real decoder (embeddings, per-layer attention/MLP matrices, norms, biases, an
untied head), so bucketing sees many tensors of very different sizes. The sender holds float32 master weights,
as the trainer does; the bf16 rows therefore include the cast the sender performs on the way. Receivers load
into preallocated tensors in place, as an engine does. The baseline is one broadcast of a flat buffer with the
same number of bytes over the same kind of standalone group, then a barrier (our transfer's time likewise ends
at the last receiver's acknowledgement). Baseline and transfer alternate within each repeat; times are medians,
and ours/raw is the median over repeats of each adjacent pair's ratio, which shared machines need.

The `shm` rows are the same-host path of a colocated run (`engines/weights/shared_memory.py`: staging buffers in
shared-memory files that the receivers copy from) against the same gloo broadcast baseline: the broadcast path
a colocated run replaces.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from engines.weights import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_DIRECT_BYTES,
    GroupSpec,
    TorchDistributedWeightReceiver,
    TorchDistributedWeightSender,
)
from engines.weights import group as groups

# Row name -> (dtype the sender holds, dtype on the wire). "fp32>bf16" is the trainer's case: float32 master
# weights cast per bucket on the way, so it includes the cast; the other two measure the protocol alone.
VARIANTS = {
    "fp32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "fp32>bf16": (torch.float32, torch.bfloat16),
}
RAW_GENERATION = 1_000_000  # a key prefix the transfer group's generations never reach


@dataclass(frozen=True)
class ModelShape:
    vocab: int
    hidden: int
    layers: int
    intermediate: int

    def tensor_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        h, i = self.hidden, self.intermediate
        shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (self.vocab, h))]
        for layer in range(self.layers):
            prefix = f"model.layers.{layer}"
            for name in ("q_proj", "k_proj", "v_proj"):
                shapes += [(f"{prefix}.self_attn.{name}.weight", (h, h)), (f"{prefix}.self_attn.{name}.bias", (h,))]
            shapes.append((f"{prefix}.self_attn.o_proj.weight", (h, h)))
            shapes += [(f"{prefix}.mlp.{name}.weight", (i, h)) for name in ("gate_proj", "up_proj")]
            shapes.append((f"{prefix}.mlp.down_proj.weight", (h, i)))
            shapes += [(f"{prefix}.{norm}.weight", (h,)) for norm in ("input_layernorm", "post_attention_layernorm")]
        return [*shapes, ("model.norm.weight", (h,)), ("lm_head.weight", (self.vocab, h))]

    @property
    def parameters(self) -> int:
        return sum(_numel(shape) for _, shape in self.tensor_shapes())


FULL = ModelShape(vocab=32000, hidden=1024, layers=16, intermediate=2816)
QUICK = ModelShape(vocab=1000, hidden=128, layers=2, intermediate=352)


@dataclass(frozen=True)
class Row:
    transport: str
    dtype: str
    receivers: int
    gigabytes: float
    raw_seconds: float
    raw_gbps: float
    transfer_seconds: float
    transfer_gbps: float
    ratio: float


def main() -> None:
    args = _parse_args()
    shape = QUICK if args.quick else FULL
    receiver_counts = [int(n) for n in args.receivers.split(",")]
    dtypes = args.dtypes.split(",")
    repeats = 1 if args.quick else args.repeats
    if args.quick:  # a smoke run: its receivers fork from here (receivers_context)
        torch.set_num_threads(1)
    print(
        f"synthetic model: {shape.parameters / 1e6:.0f}M parameters in {len(shape.tensor_shapes())} tensors; "
        f"bucket {args.bucket_mb:g} MiB, alone from {args.direct_mb:g} MiB; {repeats} repeats (medians)"
    )
    rows = [
        row
        for backend in args.backends.split(",")
        for count in receiver_counts
        for row in _run_group(shape, count, dtypes, repeats, int(args.bucket_mb * 2**20),
                              int(args.direct_mb * 2**20), backend, receivers_context(args.quick))
    ]
    _print_table(rows)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"model_parameters": shape.parameters, "rows": [asdict(r) for r in rows]}, indent=2)
        )


def receivers_context(quick: bool) -> Any:
    """How the receiving processes start. A timed run spawns new interpreters: forked, they would share this
    process's torch thread pool setting, which must be one thread (a child forked after the OpenMP pool started
    hangs in its first parallel region, tools/bench/forked.py), and the sender's timed conversions run here. A
    --quick run is a smoke run on one thread: its receivers fork, with torch and the transfer already imported."""
    return mp.get_context("fork" if quick else "spawn")


def _run_group(
    shape: ModelShape, count: int, dtypes: list[str], repeats: int, bucket_bytes: int, direct_bytes: int,
    backend: str, context: Any,
) -> list[Row]:
    names = [f"engine-{rank}" for rank in range(count)]
    ends, processes = [], []
    for name in names:  # started before the sender's store and its thread exist: each learns the group on its pipe
        ours, theirs = context.Pipe()
        processes.append(context.Process(target=_receiver_main, args=(theirs, name, shape, dtypes, repeats),
                                         daemon=True))
        ends.append(ours)
    for process in processes:
        process.start()
    sender = TorchDistributedWeightSender(bucket_bytes=bucket_bytes, direct_bytes=direct_bytes, timeout_s=300,
                                          backend=backend)
    spec = sender.open_group(["learner", *names])
    for end in ends:
        end.send(spec.to_dict())
    try:
        sender.wait_for_receivers()
        raw_group = _raw_group(sender.port, 0, count + 1)
        rows = []
        for variant in dtypes:
            held, wire = VARIANTS[variant]
            master = _synthetic_tensors(shape, held, fill=True)
            flat = torch.zeros(sum(_numel(t.shape) for _, t in master) * wire.itemsize, dtype=torch.uint8)
            raw_times, transfer_times = [], []
            for repeat in range(-1, repeats):  # repeat -1 warms up (page faults, buffer growth) untimed
                for first_raw in (True, False) if repeat % 2 == 0 else (False, True):
                    if first_raw:
                        raw_times.append(_raw_broadcast(raw_group, flat))
                    else:
                        report = sender.send(master, version=repeat + 1, dtype=wire)
                        transfer_times.append(report.seconds)
            gigabytes = flat.numel() / 1e9
            raw_times, transfer_times = raw_times[1:], transfer_times[1:]
            raw, ours = statistics.median(raw_times), statistics.median(transfer_times)
            # The ratio is the median of the PAIRED ratios (adjacent runs): robust to load drifting between pairs.
            ratio = statistics.median(r / t for r, t in zip(raw_times, transfer_times, strict=True))
            rows.append(Row(backend, variant, count, gigabytes, raw, gigabytes / raw, ours, gigabytes / ours, ratio))
            del flat, master
        return rows
    finally:
        for process in processes:
            process.join(timeout=60)
        sender.close()


def _receiver_main(conn: Connection, name: str, shape: ModelShape, dtypes: list[str], repeats: int) -> None:
    spec = GroupSpec.from_dict(conn.recv())
    receiver = TorchDistributedWeightReceiver.join(spec, name, timeout_s=300)
    raw_group = _raw_group(spec.port, spec.rank_of(name), len(spec.members), host=spec.host)
    for variant in dtypes:
        _, wire = VARIANTS[variant]
        model = dict(_synthetic_tensors(shape, wire, fill=False))
        flat = torch.zeros(sum(t.numel() for t in model.values()) * wire.itemsize, dtype=torch.uint8)

        def load(items, model=model) -> None:
            for tensor_name, tensor in items:
                model[tensor_name].copy_(tensor)

        for repeat in range(-1, repeats):
            for first_raw in (True, False) if repeat % 2 == 0 else (False, True):
                if first_raw:
                    _raw_broadcast(raw_group, flat)
                else:
                    receiver.receive(load, timeout=300, destinations=model)
        del model, flat
    receiver.close()


def _raw_group(port: int, rank: int, size: int, host: str = "127.0.0.1") -> dist.ProcessGroup:
    store = groups.connect_store(host, port, 300)
    keys = groups.generation_store(store, RAW_GENERATION)
    return groups.create_process_group(keys, rank, size, "gloo", host, 300)


def _raw_broadcast(group: dist.ProcessGroup, flat: torch.Tensor) -> float:
    started = time.perf_counter()
    groups.broadcast(group, flat).wait()
    group.barrier().wait()
    return time.perf_counter() - started


def _synthetic_tensors(shape: ModelShape, dtype: torch.dtype, *, fill: bool) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    tensors = []
    for name, size in shape.tensor_shapes():
        tensor = torch.empty(size, dtype=dtype)
        if fill:
            tensor.uniform_(-0.05, 0.05, generator=generator)
        tensors.append((name, tensor))
    return tensors


def _numel(shape: tuple[int, ...] | torch.Size) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _print_table(rows: list[Row]) -> None:
    header = (
        f"{'transport':<10}{'dtype':<10}{'receivers':>10}{'GB':>8}{'raw s':>9}{'raw GB/s':>10}"
        f"{'ours s':>9}{'ours GB/s':>11}{'ours/raw':>10}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r.transport:<10}{r.dtype:<10}{r.receivers:>10}{r.gigabytes:>8.3f}{r.raw_seconds:>9.3f}{r.raw_gbps:>10.2f}"
            f"{r.transfer_seconds:>9.3f}{r.transfer_gbps:>11.2f}{r.ratio:>9.0%}"
        )
    print("GB/s are bytes delivered to EACH receiver per second; raw: one gloo broadcast of the same bytes; "
          "target for gloo: ours/raw >= 85%")


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model, one repeat: a smoke run")
    parser.add_argument("--receivers", default="1,3", help="comma-separated receiver counts (default 1,3)")
    parser.add_argument(
        "--dtypes", default="fp32,bf16,fp32>bf16", help=f"comma-separated rows among {', '.join(VARIANTS)}"
    )
    parser.add_argument(
        "--bucket-mb", type=float, default=DEFAULT_BUCKET_BYTES / 2**20, help="bucket size in MiB (the default)"
    )
    parser.add_argument(
        "--direct-mb", type=float, default=DEFAULT_DIRECT_BYTES / 2**20, help="tensors this large travel alone"
    )
    parser.add_argument("--backends", default="gloo,shm", help="comma-separated transfer backends (gloo, shm)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the figures to this path")
    return parser.parse_args()


if __name__ == "__main__":
    main()
