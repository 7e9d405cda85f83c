"""Benchmark: what a weight push holds of a trainer that gathers its tensors, streamed against recorded specs vs
listed first (what every push did before, and what a sender still does with a source whose specs it lacks).

    python -m tools.bench.push_memory            # the ~270M-parameter synthetic decoder of weights.py
    python -m tools.bench.push_memory --quick    # a few MB, for the smoke test
    python -m tools.bench.push_memory --json out.json

The source yields a fresh copy of each float32 tensor, as the Megatron backend does when it gathers a tensor's
tensor-parallel shards and converts them to HF layout; the push casts to bf16 on the way (the trainer's case)
over gloo to one engine process that loads in place. "Held" is the peak of gathered bytes alive at once during
the push (measured on the tensors' storage, so views and in-flight broadcasts count). Listed, that is the whole
model; streamed, the buckets in flight. Both modes alternate within each repeat; times are medians. Recording the
specs (one pass that keeps nothing, once per run) is timed on its own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import weakref
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from engines.weights import GroupSpec, TorchDistributedWeightReceiver, TorchDistributedWeightSender
from engines.weights.stream import SpecifiedTensors, record_specs
from tools.bench.weights import FULL, QUICK, ModelShape, _synthetic_tensors, receivers_context

MODES = ("listed", "streamed")


class GatheringSource:
    """A fresh copy of every tensor per pass, and the peak bytes of copies alive at once."""

    def __init__(self, model: list[tuple[str, torch.Tensor]]) -> None:
        self.model = model
        self.alive = self.peak = 0

    def __call__(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.peak = self.alive
        for name, tensor in self.model:
            gathered = tensor.clone()
            self.alive += gathered.nbytes
            self.peak = max(self.peak, self.alive)
            weakref.finalize(gathered.untyped_storage(), self._released, gathered.nbytes)
            yield name, gathered
            del gathered

    def _released(self, nbytes: int) -> None:
        self.alive -= nbytes


@dataclass(frozen=True)
class Row:
    mode: str
    model_mb: float
    held_mb: float
    seconds: float
    vs_listed: float


def main() -> None:
    args = _parse_args()
    shape = QUICK if args.quick else FULL
    repeats = 1 if args.quick else args.repeats
    if args.quick:  # a smoke run: its engine forks from here (receivers_context)
        torch.set_num_threads(1)
    model = _synthetic_tensors(shape, torch.float32, fill=True)
    model_bytes = sum(tensor.nbytes for _, tensor in model)
    print(f"synthetic model: {shape.parameters / 1e6:.0f}M parameters, {model_bytes / 1e6:.0f} MB in float32, "
          f"pushed as bf16 over gloo to one engine; {repeats} repeats (medians)")
    source = GatheringSource(model)
    started = time.perf_counter()
    specs = record_specs(source())
    record_seconds = time.perf_counter() - started
    record_peak = source.peak

    context = receivers_context(args.quick)
    ours, theirs = context.Pipe()  # started before the sender's store and its thread exist: it learns the group here
    engine = context.Process(target=_engine_main, args=(theirs, shape, 2 * (repeats + 1)), daemon=True)
    engine.start()
    sender = TorchDistributedWeightSender(timeout_s=300, backend="gloo")
    ours.send(sender.open_group(["learner", "engine-0"]).to_dict())
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    held: dict[str, int] = dict.fromkeys(MODES, 0)
    try:
        sender.wait_for_receivers()
        version = 0
        for repeat in range(-1, repeats):  # repeat -1 warms up (page faults, buffer growth) untimed
            for mode in MODES if repeat % 2 == 0 else reversed(MODES):
                version += 1
                tensors = source() if mode == "listed" else SpecifiedTensors(specs, source())
                report = sender.send(tensors, version, dtype=torch.bfloat16)
                if repeat >= 0:
                    seconds[mode].append(report.seconds)
                    held[mode] = max(held[mode], source.peak)
    finally:
        engine.join(timeout=300)
        sender.close()
    listed = statistics.median(seconds["listed"])
    rows = [Row(mode, model_bytes / 1e6, held[mode] / 1e6, statistics.median(seconds[mode]),
                statistics.median(seconds[mode]) / listed) for mode in MODES]
    _print_table(rows, record_seconds, record_peak / 1e6)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"model_parameters": shape.parameters, "record_specs_seconds": record_seconds,
             "record_specs_held_mb": record_peak / 1e6, "rows": [asdict(row) for row in rows]}, indent=2))


def _engine_main(conn: Connection, shape: ModelShape, transfers: int) -> None:
    torch.set_num_threads(1)
    receiver = TorchDistributedWeightReceiver.join(GroupSpec.from_dict(conn.recv()), "engine-0", timeout_s=300)
    live = dict(_synthetic_tensors(shape, torch.bfloat16, fill=False))

    def load(items) -> None:
        for name, tensor in items:
            live[name].copy_(tensor)

    for _ in range(transfers):
        receiver.receive(load, timeout=300, destinations=live)
    receiver.close()


def _print_table(rows: list[Row], record_seconds: float, record_mb: float) -> None:
    header = f"{'push':<10}{'model MB':>10}{'held MB':>10}{'seconds':>10}{'vs listed':>11}"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{row.mode:<10}{row.model_mb:>10.0f}{row.held_mb:>10.1f}{row.seconds:>10.3f}{row.vs_listed:>10.2f}x")
    print(f"recording the specs (once per run): {record_seconds:.3f} s, {record_mb:.1f} MB held at most")
    print("held: gathered bytes alive at once during the push; listed is the baseline (the whole model). "
          "Target: streamed holds the buckets in flight, not the model, at no more than 1.1x listed's time")


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model, one repeat: a smoke run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the figures to this path")
    return parser.parse_args()


if __name__ == "__main__":
    main()
