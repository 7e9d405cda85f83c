"""The torch learner's step on one long row, split across 1, 2 or 4 context-parallel ranks: peak memory per rank and
step time.

Each measurement is one gloo world of C ranks forked from this process (its imports done, no model loaded). Every
rank builds the trainer with `context_parallel_size=C`, takes a warm-up step on a short row (the optimizer's moments
and the allocator's first pools exist after it), then one training step on a row of T tokens: one sample whose
response is the second half of the row, so its response tokens' log-probs are computed (fused head) and trained.

Memory is each rank's resident set: its high-water mark during the step (reset through /proc/self/clear_refs after
the warm-up) minus its resident set before the step, so weights, moments and the warm-up are not in it; the table
shows the largest rank's. Part of it every rank holds whatever the row: the gradients of every weight and the
optimizer's temporaries, measured by a second step on the short warm-up row; the rest is the row's activations.
What falls as 1/C is what each rank holds per token it holds: hidden states, MLP and norm activations, the head's
chunks. What does not: each layer's keys and values of the whole row, which the all-gather layout gathers on every
rank and attention keeps for the backward, as one rank holding the whole row does.

Time is the step's wall time on the slowest rank. The CPU threads are shared: C ranks of `--threads / C` threads
each, so the machine does the same work with the same cores, and the time column shows what the split and the
gathers cost, not what more devices would buy.

    python -m tools.bench.context_parallel [--quick] [--model smollm2] [--tokens 4096 8192] [--cp 1 2 4]
        [--gradient-checkpointing] [--lora RANK] [--threads 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tools.bench.allocator import MMAP_THRESHOLD_BYTES, fix_mmap_threshold
from tools.bench.long_prefill import reset_peak, resident_mib

WARM_UP_TOKENS = 64


@dataclass(frozen=True)
class Measurement:
    tokens: int
    context_parallel: int
    peak_mib: float  # the largest rank's resident-set high-water mark during the step, above its set before it
    short_peak_mib: float  # the same for a step on a short row: what a step holds whatever its length (gradients,
    #                        the optimizer's temporaries), so peak - short_peak is the row's activations
    seconds: float  # the slowest rank's step
    loss: float  # the step's loss (the same at every C: the split computes the whole row's)


@dataclass(frozen=True)
class Figures:
    model: str
    threads: int
    gradient_checkpointing: bool
    rows: list[Measurement]
    lora: int = 0  # the adapter's rank; 0: every weight trained
    mmap_threshold: int | None = None  # glibc's, fixed for the measurement (None: the allocator as it was)


@dataclass(frozen=True)
class PolicyGradientLoss:
    """-A log p over the step's response tokens, divided by their count (the learner's shape of loss)."""

    tokens: int

    def __call__(self, outputs: Any, batch: Any) -> tuple[Any, dict]:
        return -(batch.advantages * outputs.log_probs).sum() / self.tokens, {}


def rank_step(rank: int, world: int, rendezvous: str, model: str, vocabulary: int, tokens: int, threads: int,
              checkpointing: bool, lora_rank: int, out: str) -> None:
    """One rank of a measured world: warm up, reset the high-water mark, take the long row's step, write figures."""
    import torch
    import torch.distributed as dist

    from engines.training import TorchTrainer, TorchTrainerConfig, TrainSample
    from engines.training.lora import LoraSettings

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    try:
        trainer = TorchTrainer(TorchTrainerConfig(
            model_path=Path(model), lr=1e-6, check_packing=False, micro_batch_tokens=max(tokens, 8192),
            gradient_checkpointing=checkpointing, context_parallel_size=world,
            lora=LoraSettings(rank=lora_rank, alpha=2.0 * lora_rank) if lora_rank else None))
        generator = torch.Generator().manual_seed(0)

        def row(length: int) -> list[TrainSample]:
            ids = torch.randint(3, vocabulary, (length,), generator=generator)
            return [TrainSample(ids, length // 2, advantages=torch.ones(length // 2))]

        warm = row(WARM_UP_TOKENS)
        trainer.train_step(warm, PolicyGradientLoss(WARM_UP_TOKENS // 2), temperature=1.0)  # the moments appear
        dist.barrier()
        reset_peak()
        before = resident_mib("VmRSS")
        trainer.train_step(warm, PolicyGradientLoss(WARM_UP_TOKENS // 2), temperature=1.0)
        short_peak = resident_mib("VmHWM") - before
        long = row(tokens)
        dist.barrier()
        reset_peak()
        before = resident_mib("VmRSS")
        started = time.perf_counter()
        result = trainer.train_step(long, PolicyGradientLoss(tokens // 2), temperature=1.0)
        seconds = time.perf_counter() - started
        peak = resident_mib("VmHWM") - before
        Path(out, f"rank-{rank}.json").write_text(json.dumps({"peak_mib": peak, "short_peak_mib": short_peak,
                                                              "seconds": seconds, "loss": result.metrics["loss"]}))
        trainer.close()
    finally:
        dist.destroy_process_group()


def measure(model: Path, tokens: int, context: int, threads: int, checkpointing: bool, lora_rank: int = 0,
            ) -> Measurement:
    import torch.multiprocessing as mp
    from transformers import AutoConfig

    vocabulary = AutoConfig.from_pretrained(model).vocab_size
    with tempfile.TemporaryDirectory(prefix="bench-cp-") as out:
        rendezvous = f"file://{Path(out) / 'rendezvous'}"
        mp.start_processes(rank_step, args=(context, rendezvous, str(model), vocabulary, tokens,
                                            max(1, threads // context), checkpointing, lora_rank, out),
                           nprocs=context, join=True, start_method="fork")
        ranks = [json.loads(path.read_text()) for path in sorted(Path(out).glob("rank-*.json"))]
    largest = max(ranks, key=lambda r: r["peak_mib"])
    return Measurement(tokens, context, largest["peak_mib"], largest["short_peak_mib"],
                       max(r["seconds"] for r in ranks), ranks[0]["loss"])


def benchmark(args: argparse.Namespace, mmap_threshold: int | None) -> Figures:
    import torch

    from engines.training.torch_trainer import TorchTrainer  # noqa: F401  (imported here, in every forked rank)

    torch.set_num_threads(1)  # the ranks fork from here (tools/bench/forked.py says why)
    path = model_path(args)
    rows = []
    for tokens in args.tokens:
        for context in args.cp:
            rows.append(measure(path, tokens, context, args.threads, args.gradient_checkpointing, args.lora))
            print(f"  {tokens} tokens, CP {context}: {rows[-1].peak_mib:.0f} MiB, {rows[-1].seconds:.1f} s",
                  file=sys.stderr, flush=True)
    return Figures(model="quick" if args.quick else args.model, threads=args.threads,
                   gradient_checkpointing=args.gradient_checkpointing, rows=rows, lora=args.lora,
                   mmap_threshold=mmap_threshold)


def model_path(args: argparse.Namespace) -> Path:
    if args.quick:
        from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model

        cache_dir = Path(args.model_cache or Path(tempfile.gettempdir()) / "slipstream-bench-models")
        return cached_tiny_model(cache_dir, TinyModelSpec(family="qwen2"))
    from tools.bench.models import bench_model

    return bench_model(args.model)


def print_table(figures: Figures) -> None:
    recompute = "activation checkpointing" if figures.gradient_checkpointing else "no activation checkpointing"
    trained = f"a LoRA adapter of rank {figures.lora}" if figures.lora else "every weight"
    allocator = (f"glibc mmap threshold {figures.mmap_threshold // 1024} KiB" if figures.mmap_threshold
                 else "allocator's thresholds as they were")
    print(f"model: {figures.model} (fp32, CPU, {figures.threads} threads shared by the ranks, {recompute}, "
          f"{trained} trained, {allocator}) | one training step on one row | peak: the largest rank's resident-set "
          "high-water mark above its set before the step, MiB")
    print("activations: peak minus a short row's step peak (the gradients and the optimizer's temporaries, which "
          "every rank holds whatever the row)")
    print(f"{'tokens':>7}{'CP':>4}{'peak MiB':>10}{'vs CP 1':>9}{'activations':>13}{'vs CP 1':>9}{'step s':>8}"
          f"{'vs CP 1':>9}{'loss':>10}")
    baseline: dict[int, Measurement] = {}
    for row in figures.rows:
        first = baseline.setdefault(row.tokens, row)
        activations, first_activations = row.peak_mib - row.short_peak_mib, first.peak_mib - first.short_peak_mib
        print(f"{row.tokens:>7}{row.context_parallel:>4}{row.peak_mib:>10.0f}{row.peak_mib / first.peak_mib:>9.2f}"
              f"{activations:>13.0f}{activations / first_activations:>9.2f}{row.seconds:>8.1f}"
              f"{row.seconds / first.seconds:>9.2f}{row.loss:>10.4f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run on the tiny test model")
    parser.add_argument("--model", default="smollm2", help="smollm2 or qwen2.5-0.5b (tools/bench/models.py)")
    parser.add_argument("--model-cache", type=Path, help="where the --quick tiny model is built (default: tmp)")
    parser.add_argument("--tokens", type=int, nargs="+", help="row lengths (default 4096 8192; 512 with --quick)")
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2], help="context-parallel sizes, the first is "
                        "the baseline (default 1 2)")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="recompute each layer in the backward")
    parser.add_argument("--lora", type=int, default=0, metavar="RANK", help="train a LoRA adapter of this rank "
                        "instead of every weight: a rank then holds no gradients or moments of the base model, "
                        "which is how the Qwen2.5-0.5B shape fits four ranks in 24 GB (default 0: every weight)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads shared by a world's ranks (default 2)")
    parser.add_argument("--mmap-threshold", type=int, default=MMAP_THRESHOLD_BYTES, metavar="BYTES",
                        help="glibc's mmap threshold, fixed before the ranks allocate (tools/bench/allocator.py); 0 "
                        f"keeps glibc's own, which rises as blocks are freed (default {MMAP_THRESHOLD_BYTES})")
    parser.add_argument("--json", type=Path, help="write the figures to this JSON file")
    args = parser.parse_args(argv)
    if args.mmap_threshold < 0:
        parser.error(f"--mmap-threshold: bytes >= 0, got {args.mmap_threshold}")
    args.tokens = args.tokens or ([512] if args.quick else [4096, 8192])
    for tokens in args.tokens:
        if tokens < 4 * max(args.cp):
            parser.error(f"--tokens {tokens}: a row needs at least 4 tokens per context-parallel rank")
    if min(args.cp) < 1:
        parser.error(f"--cp: each size must be >= 1, got {args.cp}")
    return args


def main(argv: list[str] | None = None) -> int:
    from actors.runtime.logs import quiet_library_output

    args = parse_args(argv)
    quiet_library_output()  # transformers' load bars otherwise interleave with the progress lines
    # before the model and the ranks' allocations: tools/bench/allocator.py says why
    fixed = bool(args.mmap_threshold) and fix_mmap_threshold(args.mmap_threshold)
    figures = benchmark(args, args.mmap_threshold if fixed else None)
    print_table(figures)
    if args.json:
        args.json.write_text(json.dumps(asdict(figures), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
