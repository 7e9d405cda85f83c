"""Benchmark: full pushes against delta pushes of the same versions of real training, in the same run.

    python -m tools.bench.delta_push                     # SmolLM2-135M at the demo's full-weight lr, 5 steps
    python -m tools.bench.delta_push --quick             # the demo's tiny model
    python -m tools.bench.delta_push --model qwen2.5-0.5b --steps 3 --dtypes bfloat16
    python -m tools.bench.delta_push --dtypes bfloat16 fp8     # --rollout-fp8's pushes beside bfloat16's

The learner trains (real GRPO steps, `tools/bench/weight_deltas.py`'s trainer); after each step the same weights
are pushed by three senders over three gloo groups: delta sync off (the baseline: every push whole), on and sending
every push after the first as a delta whatever it costs (`--weight-delta-backoff 0`: what a delta costs), and on as
a run has it (`engines/weights/held.py`: full pushes for a while after a delta that was slower than a full one,
then a delta again), each to a receiver in its own process that loads every push into its own
tensors and offers them for deltas to write in place, as the torch engine does, and fingerprints them as the
run's default weight check does (stride 16). The order of
the two pushes alternates from step to step. The first push of each is full (the anchor), so the table's delta rows
are the pushes after it. Bytes are what crossed the wire per receiver; seconds run from the push's start to the
last acknowledgement, the diff against the sender's kept copy included.

Here the wire is this machine's loopback, about as fast as a memory copy, so the table shows what delta sync costs
in computation; the last line says the link bandwidth below which its fewer bytes would win that back (from the
medians: the bytes it saves over the seconds it adds).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from engines.weights import GroupSpec, TorchDistributedWeightReceiver, TorchDistributedWeightSender, fp8
from engines.weights.base import TransferReport
from engines.weights.fingerprint import FingerprintPlan, ServedPrints
from engines.weights.held import DEFAULT_BACKOFF
from engines.weights.manifest import TensorSpec
from engines.weights.stream import SpecifiedTensors, record_specs
from tools.bench.weight_deltas import DEMO_LR, WIRE_DTYPES, trainer_and_step

TIMEOUT_S = 600.0
FP8 = "fp8"
STRIDE = 16  # the run's default --weight-check-stride
# The senders, with their --weight-delta-backoff (None: delta sync off) and their rows' labels.
KINDS = {"full": (None, "full (baseline)"), "delta": (0, "delta, always"),
         "run": (DEFAULT_BACKOFF, "delta sync as run")}


@dataclass(frozen=True)
class Push:
    dtype: str
    step: int
    kind: str  # one of KINDS
    mib: float
    seconds: float
    delta_of: int | None


def _receiver_main(spec: dict, name: str, pushes: int) -> None:
    torch.set_num_threads(1)
    receiver = TorchDistributedWeightReceiver.join(GroupSpec.from_dict(spec), name, timeout_s=TIMEOUT_S)
    live: dict[str, torch.Tensor] = {}

    def load(named) -> None:
        for key, tensor in named:
            if key not in live:
                live[key] = torch.empty_like(tensor)
            live[key].copy_(tensor)

    def prints(specs: tuple[TensorSpec, ...], plan: FingerprintPlan) -> ServedPrints:
        found = plan.prints()
        for spec in plan.covered(specs):
            found.add(spec.name, live[spec.name])
        return ServedPrints(found.values())

    for _ in range(pushes):  # its tensors offered for deltas in place, as the torch engine offers its weights
        receiver.receive(load, TIMEOUT_S, fingerprint_fn=prints, in_place=live.get)
    receiver.close()


def run(model_name: str, steps: int, dtypes: list[str], prompts: int, samples_per_prompt: int) -> list[Push]:
    from transformers import AutoConfig, AutoTokenizer

    from tools.bench.learner_step import demo_batch, random_batch
    from tools.bench.models import bench_model

    # The receivers are forked before this process runs a torch op: a new interpreter each would import torch
    # again (seconds of CPU per receiver), and a child forked after the OpenMP pool started hangs in its first
    # parallel region (tools/bench/forked.py).
    context = mp.get_context("fork")
    senders: dict[tuple[str, str], TorchDistributedWeightSender] = {}
    processes = []
    for dtype in dtypes:
        for kind, (backoff, _) in KINDS.items():
            sender = TorchDistributedWeightSender(timeout_s=TIMEOUT_S, fingerprint_stride=STRIDE,
                                                  delta_sync=backoff is not None, delta_backoff=backoff or 0)
            spec = sender.open_group(["learner", f"engine-{dtype}-{kind}"])
            process = context.Process(target=_receiver_main, args=(spec.to_dict(), spec.members[1], steps + 1),
                                      daemon=True)
            process.start()
            processes.append(process)
            senders[dtype, kind] = sender
    model = bench_model(model_name)
    trainer, step = trainer_and_step(model, DEMO_LR[model_name], samples_per_prompt)
    tokenizer = AutoTokenizer.from_pretrained(model)
    vocab = AutoConfig.from_pretrained(model).vocab_size
    specs = record_specs(trainer.named_tensors())
    for sender in senders.values():
        sender.wait_for_receivers(TIMEOUT_S)
    pushes: list[Push] = []
    try:
        for index in range(steps + 1):
            if index:
                samples = (demo_batch(tokenizer, prompts, samples_per_prompt, seed=index) if model_name == "tiny"
                           else random_batch(vocab, prompts, samples_per_prompt, 32, 24, seed=index))
                step.train(samples, [0] * len(samples))
            for dtype in dtypes:
                kinds = list(KINDS)
                for kind in kinds[index % 3:] + kinds[:index % 3]:  # each sender first in turn
                    tensors, wire = _push(trainer, dtype, specs)
                    report: TransferReport = senders[dtype, kind].send(tensors, index, dtype=wire, fingerprint=True)
                    assert report.fingerprints is not None and report.fingerprints.ok, report.fingerprints
                    pushes.append(Push(dtype, index, kind, report.num_bytes / 2**20, report.seconds,
                                       report.delta_base))
            print(f"  version {index} pushed", flush=True)
    finally:
        for sender in senders.values():
            sender.close()
        for process in processes:
            process.join(60)
    return pushes


def _push(trainer, dtype: str, specs: tuple[TensorSpec, ...]) -> tuple[Iterable, torch.dtype | None]:
    """(The tensors, the dtype the sender casts them to) of one push in `dtype`: FP8 is quantised as the learner's
    publisher does under --rollout-fp8 (the projections in FP8 with their scales, the rest in bfloat16)."""
    if dtype == FP8:
        return fp8.quantised_push(SpecifiedTensors(specs, trainer.named_tensors()), torch.bfloat16), None
    return trainer.named_tensors(), WIRE_DTYPES[dtype]


def print_table(model_name: str, steps: int, pushes: list[Push], kept_mib: dict[str, float]) -> None:
    print(f"\nmodel {model_name}: pushes of {steps} versions of real training (after the first, full, push), "
          f"gloo, one receiver each, fingerprinted at stride {STRIDE}; medians [min-max]")
    print(f"{'wire dtype':<10} {'push':<18} {'MiB':>22} {'seconds':>22} {'sender copy MiB':>16}")
    even, run = [], []
    for dtype in sorted({push.dtype for push in pushes}, reverse=True):
        medians = {}
        for kind, (backoff, label) in KINDS.items():
            rows = [push for push in pushes if push.dtype == dtype and push.kind == kind and push.step > 0]
            mib = [row.mib for row in rows]
            seconds = [row.seconds for row in rows]
            medians[kind] = statistics.median(mib), statistics.median(seconds)
            deltas = sum(row.delta_of is not None for row in rows)
            kept = f"{kept_mib[dtype]:.0f}" if backoff is not None else "0"
            print(f"{dtype:<10} {label:<18} {statistics.median(mib):>8.1f} [{min(mib):.1f}-{max(mib):.1f}]"
                  f" {statistics.median(seconds):>9.3f} [{min(seconds):.3f}-{max(seconds):.3f}] {kept:>16}"
                  + (f"   ({deltas} of {len(rows)} pushes were deltas)" if backoff is not None else ""))
        saved, added = medians["full"][0] - medians["delta"][0], medians["delta"][1] - medians["full"][1]
        even.append(f"{dtype}: " + ("never (it saves no bytes)" if saved <= 0 else "always (it adds no time)"
                                    if added <= 0 else f"{saved * 2**20 * 8 / added / 1e9:.2f} Gbit/s"))
        run.append(f"{dtype}: {medians['run'][1] / medians['full'][1]:.2f}x")
    print("an always-delta push wins below a link of: " + "; ".join(even))
    print("delta sync as a run has it, median seconds against the full baseline: " + "; ".join(run))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="tiny, smollm2 or qwen2.5-0.5b (tools/bench/models.py)")
    parser.add_argument("--quick", action="store_true", help="the demo's tiny model")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dtypes", nargs="+", choices=[*sorted(WIRE_DTYPES), FP8], default=["float32", "bfloat16"],
                        help=f"{FP8}: a --rollout-fp8 push (FP8 projections, the rest bfloat16)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples-per-prompt", type=int, default=8)
    args = parser.parse_args(argv)
    from actors.runtime.logs import quiet_library_output

    quiet_library_output()
    model_name = "tiny" if args.quick else args.model
    torch.manual_seed(0)
    pushes = run(model_name, args.steps, args.dtypes, args.prompts, args.samples_per_prompt)
    full = {push.dtype: push.mib for push in pushes if push.step == 0 and push.kind == "full"}
    print_table(model_name, args.steps, pushes, full)


if __name__ == "__main__":
    main()
