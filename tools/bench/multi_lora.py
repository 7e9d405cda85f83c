"""Benchmark: one decode step of a batch mixing LoRA adapters, against the same step with one adapter merged.

    python -m tools.bench.multi_lora           # SmolLM2-135M-Instruct, rank 16 on every linear layer
    python -m tools.bench.multi_lora --quick   # the tiny model, few repeats: the smoke test

A run of several policies serves every policy's adapter unmerged (`engines/inference/multi_lora.py`), so a decode
step pays each adapted layer's low-rank products on top of the base model's work; a run of one policy merges its
adapter into the weights and pays nothing. This measures what sharing an engine costs per step: the forward of
`rows` one-token rows (a decode step) with the adapter merged (the baseline), and with two and four adapters
unmerged, the rows split evenly between them. Medians of the repeats, one torch thread, after a warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from engines.inference.multi_lora import MultiLora

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
REPO = Path(__file__).resolve().parents[2]


def random_adapter(model: nn.Module, rank: int, seed: int) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    factors = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS:
            lora_a = torch.randn(rank, module.in_features, generator=generator)
            lora_b = torch.randn(module.out_features, rank, generator=generator)
            factors += [(f"{name}.lora_A.weight", 0.01 * lora_a), (f"{name}.lora_B.weight", 0.01 * lora_b)]
    return factors


def step_seconds(model: nn.Module, rows: int, repeats: int, served: MultiLora | None = None,
                 adapters: list[str | None] | None = None) -> float:
    vocabulary = model.get_input_embeddings().num_embeddings
    tokens = torch.randint(0, vocabulary, (rows, 1), generator=torch.Generator().manual_seed(0))
    times = []
    with torch.inference_mode():
        for repeat in range(repeats + 1):
            started = time.perf_counter()
            if served is None:
                model(input_ids=tokens)
            else:
                with served.adapter_rows(adapters or [], "cpu"):
                    model(input_ids=tokens)
            if repeat:  # the first is the warm-up
                times.append(time.perf_counter() - started)
    return statistics.median(times)


def load_model(quick: bool) -> nn.Module:
    from transformers import AutoModelForCausalLM

    if quick:
        from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model

        path = cached_tiny_model(REPO / ".cache" / "models", TinyModelSpec(family="qwen2"))
    else:
        from engines.pretrained import SMOLLM2, cached_pretrained

        path = cached_pretrained(SMOLLM2, REPO / ".cache")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the tiny model and 3 repeats")
    parser.add_argument("--rows", type=int, default=16, help="rows of the decode step")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = load_model(args.quick)
    repeats = 3 if args.quick else args.repeats
    baseline = step_seconds(model, args.rows, repeats)  # merged: the base model's cost
    results = [("one adapter, merged (baseline)", baseline)]
    for count in (2, 4):
        served = MultiLora(model)
        names = [f"policy{index}" for index in range(count)]
        for index, name in enumerate(names):
            served.load(name, random_adapter(model, args.rank, index), 2.0)
        rows: list[str | None] = [names[row % count] for row in range(args.rows)]
        results.append((f"{count} adapters, unmerged", step_seconds(model, args.rows, repeats, served, rows)))
        for name in names:
            served.remove(name)
    print(f"one decode step of {args.rows} rows, LoRA rank {args.rank} on every linear layer, one thread")
    print(f"{'serving':<34}{'ms/step':>10}{'vs baseline':>13}")
    for label, seconds in results:
        print(f"{label:<34}{seconds * 1000:>10.1f}{seconds / baseline:>12.2f}x")


if __name__ == "__main__":
    main()
