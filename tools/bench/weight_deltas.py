"""Measurement: how many elements of the pushed weights change between consecutive versions of full fine-tuning.

    python -m tools.bench.weight_deltas                  # SmolLM2-135M at the demo's full-weight lr (3e-5)
    python -m tools.bench.weight_deltas --quick          # the demo's tiny model at its lr (1.5e-4)
    python -m tools.bench.weight_deltas --model qwen2.5-0.5b --steps 3

What decides a delta push's encoding (`engines/weights/delta.py`): the learner runs real GRPO steps
(`actors.learner.step.TrainingStep` with the torch trainer, AdamW) on demo-shaped batches, and after each step the
weights it would push (`Trainer.named_tensors`) are cast to each wire dtype (float32: a run without --bf16;
bfloat16: with it) and compared bit for bit with the previous version's. The table gives, per tensor kind and
overall, the fraction of elements that changed, and what a delta push would send in each dtype against a full push
(each tensor in its smallest encoding: dense, changed indices + values, or a bitmap + values).
"""

from __future__ import annotations

import argparse
import re
import statistics
from collections import defaultdict
from pathlib import Path

import torch

from engines.weights import delta

DEMO_LR = {"tiny": 1.5e-4, "smollm2": 3e-5, "qwen2.5-0.5b": 3e-5}  # tools/demo.py: GRPO, SmolLM2's every weight
WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def kind_of(name: str) -> str:
    """`model.layers.3.mlp.up_proj.weight` -> `mlp.up_proj.weight`: one row per kind of tensor, over the layers."""
    return re.sub(r"^model\.layers\.\d+\.", "", name).removeprefix("model.")


def trainer_and_step(model: Path, lr: float, samples_per_prompt: int):
    from actors.config import build_config
    from actors.learner.step import TrainingStep
    from actors.learner.trainer_factory import build_trainer

    config = build_config({"hf_checkpoint": str(model), "n_samples_per_prompt": samples_per_prompt,
                           "advantage_estimator": "grpo", "loss_agg_mode": "token-mean", "lr": lr,
                           "off_policy_correction": "tis", "micro_batch_tokens": 1 << 20})
    trainer = build_trainer(config)
    return trainer, TrainingStep(trainer, config)


def snapshot(trainer, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {name: tensor.to(dtype, copy=True) for name, tensor in trainer.named_tensors()}


def measure(model_name: str, steps: int, prompts: int, samples_per_prompt: int, lr: float) -> dict:
    from transformers import AutoConfig, AutoTokenizer

    from tools.bench.learner_step import demo_batch, random_batch
    from tools.bench.models import bench_model

    model = bench_model(model_name)
    trainer, step = trainer_and_step(model, lr, samples_per_prompt)
    tokenizer = AutoTokenizer.from_pretrained(model)
    vocab = AutoConfig.from_pretrained(model).vocab_size
    # per dtype, per tensor: the changed count at each step
    counts: dict[str, dict[str, list[int]]] = {d: defaultdict(list) for d in WIRE_DTYPES}
    numels: dict[str, int] = {}
    before = {label: snapshot(trainer, dtype) for label, dtype in WIRE_DTYPES.items()}
    for index in range(steps):
        samples = (demo_batch(tokenizer, prompts, samples_per_prompt, seed=index) if model_name == "tiny" else
                   random_batch(vocab, prompts, samples_per_prompt, 32, 24, seed=index))
        step.train(samples, [0] * len(samples))
        for label, dtype in WIRE_DTYPES.items():
            after = snapshot(trainer, dtype)
            for name, tensor in after.items():
                counts[label][name].append(int(delta.changed(before[label][name], tensor).sum()))
                numels[name] = tensor.numel()
            before[label] = after
        print(f"  step {index + 1}/{steps} trained", flush=True)
    return {"counts": counts, "numels": numels}


def print_table(model_name: str, lr: float, steps: int, result: dict) -> None:
    counts, numels = result["counts"], result["numels"]
    print(f"\nmodel {model_name}, full fine-tuning, AdamW lr {lr:g}, {steps} steps: fraction of elements that "
          "changed between consecutive versions (median over steps [min-max])")
    kinds: dict[str, list[str]] = defaultdict(list)
    for name in numels:
        kinds[kind_of(name)].append(name)
    print(f"{'tensor (all layers)':<34} {'elements':>11} " + " ".join(f"{label:>26}" for label in WIRE_DTYPES))

    def cell(label: str, names: list[str]) -> str:
        total = sum(numels[name] for name in names)
        fractions = [sum(counts[label][name][i] for name in names) / total for i in range(steps)]
        return f"{statistics.median(fractions):>9.2%} [{min(fractions):.2%}-{max(fractions):.2%}]"

    for kind, names in kinds.items():
        print(f"{kind:<34} {sum(numels[n] for n in names):>11,} " + " ".join(
            f"{cell(label, names):>26}" for label in WIRE_DTYPES))
    print(f"{'overall':<34} {sum(numels.values()):>11,} " + " ".join(
        f"{cell(label, list(numels)):>26}" for label in WIRE_DTYPES))
    print("\nwhat a delta push sends against a full push (each tensor in its smallest encoding), median over steps")
    for label, dtype in WIRE_DTYPES.items():
        itemsize = dtype.itemsize
        full = sum(numels.values()) * itemsize
        sizes = [delta.wire_nbytes(dict.fromkeys(numels, itemsize), numels,
                                   {name: counts[label][name][i] for name in numels}) for i in range(steps)]
        chosen: dict[str, int] = defaultdict(int)
        for name in numels:
            median_count = int(statistics.median(counts[label][name]))
            chosen[delta.smallest(numels[name], median_count, itemsize)] += 1
        print(f"  {label:<9} full {full / 2**20:8.1f} MiB, delta {statistics.median(sizes) / 2**20:8.1f} MiB "
              f"({statistics.median(sizes) / full:.1%}); encodings chosen: "
              + ", ".join(f"{encoding} {chosen[encoding]}" for encoding in delta.ENCODINGS))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="tiny, smollm2 or qwen2.5-0.5b (tools/bench/models.py)")
    parser.add_argument("--quick", action="store_true", help="the demo's tiny model")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples-per-prompt", type=int, default=8)
    parser.add_argument("--lr", type=float, default=None, help="default: the demo's for the model")
    args = parser.parse_args(argv)
    from actors.runtime.logs import quiet_library_output

    quiet_library_output()
    model_name = "tiny" if args.quick else args.model
    lr = DEMO_LR[model_name] if args.lr is None else args.lr
    torch.manual_seed(0)
    print_table(model_name, lr, args.steps, measure(model_name, args.steps, args.prompts, args.samples_per_prompt, lr))


if __name__ == "__main__":
    main()
