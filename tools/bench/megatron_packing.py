"""Benchmark: the Megatron trainer's packed rows (THD, the default) against padded rows (BSHD), same batch.

    python -m tools.bench.megatron_packing            # 48 samples, lognormal lengths, 1024-token micro-batches
    python -m tools.bench.megatron_packing --workload short   # the CPU demo's RL batch
    python -m tools.bench.megatron_packing --quick    # a few samples on the tiny model, for the smoke test
    python -m tools.bench.megatron_packing --json out.json

Each measurement is one train step (forward, backward, megatron's optimizer) of `MegatronTrainer` on the same
batch and model, on the CPU path here (the GPU where CUDA is). The layouts alternate within each repeat, each in
a freshly built trainer (megatron keeps one parallel state per process) after one warm-up step; medians are
shown. Columns: micro-batches (forward passes), the share of computed token slots that are padding, step seconds,
real tokens per second, and the ratio to padded rows, the baseline (`--qkv-format bshd`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import Tensor

from engines.megatron.batches import plan_micro_batches
from engines.training.base import ModelOutputs, PackedBatch, TrainSample
from tools.bench import packing as bench_packing
from tools.bench.packing import Workload
from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model

LAYOUTS = ("thd", "bshd")


FULL = Workload(
    samples=48,
    log_mean=4.6,
    log_sigma=0.8,
    max_length=512,
    budget=1024,
    model=bench_packing.FULL.model,  # 256 hidden x 4 layers
)
SHORT = bench_packing.SHORT  # the CPU demo's RL batch: 256 samples of 5-11 tokens
QUICK = Workload(samples=8, log_mean=3.0, log_sigma=0.8, max_length=96, budget=160, model=TinyModelSpec())


@dataclass(frozen=True)
class LayoutRow:
    layout: str
    micro_batches: int
    padded_fraction: float
    seconds: float
    tokens_per_second: float
    speedup: float


@dataclass(frozen=True)
class PolicyGradientLoss:
    """-advantage x log-prob, token mean over the step (what every RL loss spends its time on: the log-probs)."""

    loss_tokens: int

    def __call__(self, outputs: ModelOutputs, batch: PackedBatch) -> tuple[Tensor, dict]:
        assert batch.advantages is not None and batch.loss_mask is not None
        return -(batch.advantages * outputs.log_probs * batch.loss_mask).sum() / self.loss_tokens, {}


def main() -> None:
    args = _parse_args()
    _quiet()
    workload = QUICK if args.quick else {"long": FULL, "short": SHORT}[args.workload]
    repeats = 1 if args.quick else args.repeats
    samples = make_samples(workload, seed=args.seed)
    lengths = [int(s.tokens.numel()) for s in samples]
    print(
        f"{len(samples)} samples, {sum(lengths)} tokens, lengths median {int(statistics.median(lengths))} / max "
        f"{max(lengths)} (lognormal); micro-batches of at most {workload.budget} tokens; {repeats} repeats"
    )
    with tempfile.TemporaryDirectory(prefix="bench-megatron-packing-") as cache:
        model_path = cached_tiny_model(Path(cache), workload.model)
        seconds = {layout: [] for layout in LAYOUTS}
        for _ in range(repeats):
            for layout in LAYOUTS:
                seconds[layout].append(time_step(model_path, samples, workload.budget, layout))
    rows = summarise(samples, workload.budget, seconds)
    _print(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": [asdict(r) for r in rows], "tokens": sum(lengths)}, indent=2))


def make_samples(workload: Workload, seed: int) -> list[TrainSample]:
    """The packing benchmark's lognormal lengths and responses, with advantages for the loss."""
    generator = torch.Generator().manual_seed(seed)
    return [
        replace(sample, advantages=torch.randn(sample.response_length, generator=generator),
                loss_mask=torch.ones(sample.response_length))
        for sample in bench_packing.make_samples(workload, seed)
    ]


def time_step(model_path: Path, samples: list[TrainSample], budget: int, layout: str) -> float:
    """Seconds of one train step in a fresh trainer, after a warm-up step."""
    from engines.megatron import MegatronTrainer, MegatronTrainerConfig

    trainer = MegatronTrainer(
        MegatronTrainerConfig(model_path=model_path, micro_batch_tokens=budget, qkv_format=layout, lr=1e-5)
    )
    try:
        loss = PolicyGradientLoss(loss_tokens=sum(s.response_length for s in samples))
        trainer.train_step(samples, loss, temperature=1.0)
        started = time.perf_counter()
        result = trainer.train_step(samples, loss, temperature=1.0)
        elapsed = time.perf_counter() - started
        if result.skipped:
            raise RuntimeError(f"the {layout} step was skipped: {result.metrics}")
        return elapsed
    finally:
        trainer.close()


def summarise(samples: list[TrainSample], budget: int, seconds: dict[str, list[float]]) -> list[LayoutRow]:
    tokens = sum(int(s.tokens.numel()) for s in samples)
    members = list(range(len(samples)))
    baseline = statistics.median(seconds["bshd"])
    rows = []
    for layout in LAYOUTS:
        plan = plan_micro_batches(samples, members, budget, qkv_format=layout, with_batch=False)
        computed = sum(mb.input_ids.numel() for mb in plan)
        median = statistics.median(seconds[layout])
        rows.append(LayoutRow(layout, len(plan), 1 - tokens / computed, median, tokens / median, baseline / median))
    return rows


def _print(rows: list[LayoutRow]) -> None:
    names = {"thd": "packed (thd)", "bshd": "padded (bshd), baseline"}
    print(f"{'layout':<24} {'micro-batches':>13} {'padding':>8} {'step s':>8} {'tokens/s':>9} {'speedup':>8}")
    for row in rows:
        print(f"{names[row.layout]:<24} {row.micro_batches:>13} {row.padded_fraction:>7.1%} {row.seconds:>8.3f} "
              f"{row.tokens_per_second:>9.0f} {row.speedup:>7.2f}x")


def _quiet() -> None:
    """The table, not megatron's notes on the kernels a CPU lacks (TE, apex), the torch calls it makes that torch
    has deprecated, or Hugging Face's progress bars."""
    from actors.runtime.logs import quiet_library_output

    quiet_library_output()
    warnings.filterwarnings("ignore", category=UserWarning, module=r"(megatron|mbridge)\.")
    warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=("long", "short"), default="long",
                        help="long: lognormal lengths up to 512; short: the CPU demo's 256 samples of 5-11 tokens")
    parser.add_argument("--quick", action="store_true", help="a few samples on the tiny model (smoke test)")
    parser.add_argument("--repeats", type=int, default=3, help="steps timed per layout (medians shown)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the rows here")
    return parser.parse_args()


if __name__ == "__main__":
    main()
