"""What checking every push costs (`--weight-check`): a push with fingerprints against the same push without.

    python -m tools.bench.fingerprint                # the demo's adapter, SmolLM2 whole, the Qwen2.5-0.5B shape
    python -m tools.bench.fingerprint --quick        # the tiny model only (CI: tests/engines/test_weights_bench.py)
    python -m tools.bench.fingerprint --json out.json

Each row pushes a trainer's weights from this process to a torch engine in its own process over gloo, as a CPU
run does, rotating unchecked pushes, pushes checked as runs check them by default (one of 16 slices of each
matrix's rows, `--weight-check-stride 16`) and pushes checked byte for byte (stride 1, slime's
--check-weight-update-equal), so all three meet the same machine; the baseline is the unchecked push, measured in
the same run. Each checked push is compared with the unchecked pushes just before and after it, so a change in
the machine's load cancels; the table gives the median ratio and its quartiles. The check's cost is the sender
fingerprinting what it sends plus the engine fingerprinting what it serves before it acknowledges. Target: at most
2% of the push time, for the default. On a small shared machine the push times still move by more than that from
push to push, so the table also gives what fingerprinting took on each end, as each measured it
(`FingerprintCheck.seconds`): the sender's runs beside its broadcasts and the engines' loads, the engine's beside
its generation, which resumed once the weights were in. And how long each push paused the engine's generation
(the loader's `paused_ms`), unchecked, and for a default push over its unchecked neighbours. A second table gives
each algorithm's own speed on this machine (XXH3 over the bytes on a CPU; the device sum is what a GPU uses).
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from actors.runtime.logs import quiet_library_output
from engines.training.lora import LoraSettings
from engines.weights.fingerprint import ALGORITHMS, fingerprint_all
from tools.bench.engine_process import forked_engine, order_pushes
from tools.bench.forked import ForkedWorker
from tools.bench.models import bench_model

ROWS = {"tiny": ("tiny", None), "smollm2-lora": ("smollm2", 16), "smollm2": ("smollm2", None),
        "qwen2.5-0.5b": ("qwen2.5-0.5b", None)}  # by label: (model, LoRA rank or None)
QUICK_ROWS = ("tiny",)
TARGET = 0.02
DEFAULT_STRIDE = 16  # --weight-check-stride's default
KINDS = ("unchecked", "strided", "full")  # pushed in turn; the stride each checked kind fingerprints with
STRIDES = {"strided": DEFAULT_STRIDE, "full": 1}


@dataclass
class PushRow:
    """Medians over a row's pushes of each kind; each cost is the median of a checked push's time over the mean of
    the unchecked pushes just before and after it (paired, so a drift of the machine's load cancels), with the
    quartiles of those ratios as the spread."""

    model: str
    update: str
    megabytes: float
    tensors: int
    unchecked_s: float
    checked_s: float  # the default: a 16th of the rows
    full_s: float  # every byte
    overhead: float  # the default's push time over the unchecked neighbours', less one
    overhead_q1: float
    overhead_q3: float
    full_overhead: float
    sender_s: float  # what fingerprinting took the sender in a default push
    engine_s: float  # ... and the engine
    paused_s: float  # how long an unchecked push paused the engine's generation
    pause_overhead: float  # a default push's pause over its unchecked neighbours', less one (paired, as above)

    @property
    def engine_share(self) -> float:
        return self.engine_s / self.unchecked_s


@dataclass
class SpeedRow:
    algorithm: str
    megabytes: float
    seconds: float


def push_row(model: str, rank: int | None, repeats: int, engine: ForkedWorker, errors: Path) -> PushRow:
    from engines.training import TorchTrainer, TorchTrainerConfig
    from engines.weights import TorchDistributedWeightSender

    path = bench_model(model)
    adapter = LoraSettings(rank=rank, alpha=2.0 * rank) if rank is not None else None
    trainer = TorchTrainer(TorchTrainerConfig(model_path=path, check_packing=False, lora=adapter))
    sender = TorchDistributedWeightSender(timeout_s=600)
    spec = sender.open_group(["learner", "engine-0"])
    pushes = len(KINDS) * repeats + 1
    order_pushes(engine, str(path), spec.to_dict(), adapter.scaling if adapter else None, pushes, report_pauses=True)
    kinds: dict[int, str] = {}
    times: dict[int, float] = {}
    paused: dict[int, float] = {}
    spent: dict[str, list[float]] = {"sender": [], "engine-0": []}  # by each end, in default pushes
    try:
        sender.wait_for_receivers()
        report = sender.send(trainer.named_tensors(), version=1, fingerprint=True)  # warm-up, untimed
        assert report.fingerprints is not None and report.fingerprints.ok, report.fingerprints
        paused.update(_pause(engine, model))
        for version in range(2, pushes + 1):
            kind = kinds[version] = KINDS[version % len(KINDS)]
            sender.fingerprint_stride = STRIDES.get(kind, 1)
            started = time.perf_counter()
            report = sender.send(trainer.named_tensors(), version=version, fingerprint=kind != "unchecked")
            times[version] = time.perf_counter() - started
            paused.update(_pause(engine, model))
            if kind != "unchecked":
                assert report.fingerprints is not None and report.fingerprints.matched == ("engine-0",)
            if kind == "strided":
                for end, seconds in spent.items():
                    seconds.append(report.fingerprints.seconds[end])
        if engine.wait(timeout=300) != 0:
            raise RuntimeError(f"bench fingerprint: the engine of the {model} row exited with {engine.returncode}:\n"
                               f"{errors.read_text()[-3000:]}")
    finally:
        engine.kill()
        sender.close()
        trainer.close()
    median = {kind: statistics.median(times[v] for v in times if kinds[v] == kind) for kind in KINDS}
    costs = paired(times, kinds, "strided")
    quartiles = statistics.quantiles(costs, n=4) if len(costs) > 1 else [costs[0]] * 3
    return PushRow(model, f"LoRA rank {rank}" if rank else "full weights", report.num_bytes / 1e6,
                   report.num_tensors, *(median[kind] for kind in KINDS), statistics.median(costs), quartiles[0],
                   quartiles[2], statistics.median(paired(times, kinds, "full")),
                   *(statistics.median(spent[end]) for end in ("sender", "engine-0")),
                   statistics.median(paused[v] for v in times if kinds[v] == "unchecked"),
                   statistics.median(paired(paused, kinds, "strided")))


def _pause(engine: ForkedWorker, model: str) -> dict[int, float]:
    """The pause the engine reports for the push just sent (it prints it once the push resumed its generation)."""
    line = engine.stdout.readline()
    if not line:
        raise RuntimeError(f"bench fingerprint: the engine of the {model} row ended without reporting its pause")
    record = json.loads(line)
    return {record["version"]: record["paused_ms"] / 1000}


def paired(values: dict[int, float], kinds: dict[int, str], kind: str) -> list[float]:
    """For each push of `kind`, its value over the mean of the nearest unchecked pushes before and after it, less
    one."""
    ratios = []
    for version in sorted(v for v in values if kinds.get(v) == kind):
        neighbours = [values[v] for v in (_nearest(kinds, version, -1), _nearest(kinds, version, 1)) if v in values]
        if neighbours:
            ratios.append(values[version] / statistics.fmean(neighbours) - 1.0)
    return ratios


def _nearest(kinds: dict[int, str], version: int, step: int) -> int:
    version += step
    while version in kinds and kinds[version] != "unchecked":
        version += step
    return version


def speed_rows(megabytes: int) -> list[SpeedRow]:
    tensors = [("w", torch.randn(megabytes * (1 << 20) // 4))]
    rows = []
    for algorithm in ALGORITHMS:
        fingerprint_all(tensors, algorithm)  # warm-up: the device sum's position weights
        started = time.perf_counter()
        fingerprint_all(tensors, algorithm)
        rows.append(SpeedRow(algorithm, float(megabytes), time.perf_counter() - started))
    return rows


def print_tables(pushes: list[PushRow], speeds: list[SpeedRow]) -> None:
    print(f"weight push with and without --weight-check (gloo, one engine; target <= {TARGET:.0%} of the push for "
          f"the default, a {DEFAULT_STRIDE}th of the rows; costs paired with the unchecked pushes beside each, "
          "median [quartiles])")
    print(f"{'model':<14}{'update':<16}{'MB':>8}{'tensors':>9}{'unchecked s':>13}{'default s':>11}"
          f"{'cost [q1, q3]':>24}{'every byte s':>14}{'cost':>8}{'default: sender ms':>20}{'engine ms':>11}"
          f"{'engine/push':>13}{'pause s':>9}{'pause cost':>12}")
    for row in pushes:
        spread = f"{row.overhead:+.1%} [{row.overhead_q1:+.1%}, {row.overhead_q3:+.1%}]"
        print(f"{row.model:<14}{row.update:<16}{row.megabytes:>8.1f}{row.tensors:>9}{row.unchecked_s:>13.3f}"
              f"{row.checked_s:>11.3f}{spread:>24}{row.full_s:>14.3f}{row.full_overhead:>+8.1%}"
              f"{1000 * row.sender_s:>20.1f}{1000 * row.engine_s:>11.1f}{row.engine_share:>13.1%}"
              f"{row.paused_s:>9.3f}{row.pause_overhead:>+12.1%}")
    print("\nfingerprint speed on this machine's CPU, one tensor")
    print(f"{'algorithm':<12}{'MB':>8}{'seconds':>10}{'GB/s':>8}")
    for speed in speeds:
        print(f"{speed.algorithm:<12}{speed.megabytes:>8.0f}{speed.seconds:>10.3f}"
              f"{speed.megabytes / 1024 / speed.seconds:>8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the tiny model only, 2 repeats")
    parser.add_argument("--repeats", type=int, default=5, help="checked and unchecked pushes per row")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"which rows, comma-separated, of {', '.join(ROWS)}")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the trainer (the engine has 1)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    quiet_library_output()  # the table, not a progress bar per model load
    repeats = 2 if args.quick else args.repeats
    labels = QUICK_ROWS if args.quick else tuple(args.rows.split(","))
    if unknown := [label for label in labels if label not in ROWS]:
        parser.error(f"--rows: unknown {', '.join(unknown)}; choose from {', '.join(ROWS)}")
    rows = [ROWS[label] for label in labels]
    with tempfile.TemporaryDirectory(prefix="bench-fingerprint-") as scratch:
        # Each row's engine forked before this process's first torch op, with what it runs imported, and torch on
        # one thread until the last fork (tools/bench/forked.py): not a new interpreter importing them again.
        importlib.import_module("engines.inference")
        torch.set_num_threads(1)
        engines = [forked_engine(Path(scratch) / f"engine-{index}.err") for index in range(len(rows))]
        torch.set_num_threads(args.threads)
        try:
            pushes = [push_row(model, rank, repeats, engine, Path(scratch) / f"engine-{index}.err")
                      for index, (engine, (model, rank)) in enumerate(zip(engines, rows, strict=True))]
        finally:
            for engine in engines:
                engine.kill()
    speeds = speed_rows(16 if args.quick else 256)
    print_tables(pushes, speeds)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"pushes": [{**asdict(r), "engine_share": r.engine_share} for r in pushes],
                                         "speeds": [asdict(s) for s in speeds]}, indent=2))


if __name__ == "__main__":
    main()
