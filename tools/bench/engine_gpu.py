"""Decode throughput at a real model's shape: HF `generate()` against the torch engine's two KV layouts.

    python -m tools.bench.engine_gpu [--shape qwen2.5-0.5b] [--batches 64 256] [--json PATH]
    python -m tools.bench.engine_gpu --device cpu --shape tiny --batches 4    # the CPU smoke (CI)

The model is built from its config with random weights on the device (nothing to carry to an offline GPU
machine): Qwen2.5-0.5B's shape is 24 layers, 896 hidden, 14 query and 2 KV heads, 4864 FFN, a 151,936-token
vocabulary, bf16. The workload is an RL rollout's: 2 x batch prompts of 32..128 random tokens, sampled at
temperature 1, answer lengths drawn from a truncated Pareto (most short, a few at the cap) and imposed on every
side (`tools/bench/engine.py`), so all sides generate the same tokens. Rows, per batch size, in one process:

* `generate()`: consecutive batches of `batch` prompts; a batch runs until its longest row is done (baseline);
* engine, dynamic KV (v1): continuous batching on caches sized to the rows;
* engine, static KV pool (v2) eager, then with CUDA graphs: continuous batching on a pool allocated once, each
  decode step one graph replay.

Each engine side generates the workload once untimed first (graph capture and allocator growth stay out of the
timing) and then once timed. Prints tokens/s, the speed-up over `generate()` and the mean decode-step time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import torch

from engines.inference import GenerateRequest, SamplingParams, TorchEngine
from tools.bench.engine import Workload, heavy_tailed_lengths, run_baseline
from tools.bench.models import QWEN25_05B_SHAPE

SHAPES = {
    "qwen2.5-0.5b": QWEN25_05B_SHAPE,
    "tiny": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False, max_position_embeddings=4096),
}


def build_model(shape: str, device: str) -> torch.nn.Module:
    """A Qwen2 causal LM of `shape` with random weights, bf16 on CUDA and fp32 on the CPU, built where it runs
    (`tools/bench/models.py` writes the same shape to disk for benchmarks that load a folder)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SHAPES[shape], bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype)
    return model.eval()


def make_workload(count: int, vocab: int, longest: int, seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(32, 128))] for _ in range(count)]
    return Workload(prompts, heavy_tailed_lengths(count, shortest=16, longest=longest, alpha=1.1, rng=rng))


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_generate(model: torch.nn.Module, workload: Workload, batch: int, device: str) -> tuple[float, int]:
    """`run_baseline` with its CPU tensors moved to the model's device."""
    original = model.generate

    def on_device(input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs: object) -> torch.Tensor:
        return original(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), **kwargs)

    model.generate = on_device  # type: ignore[method-assign]
    try:
        run_baseline(model, Workload(workload.prompts[:2], [2, 2]), batch, 0)  # lazy initialisation
        _sync(device)
        return run_baseline(model, workload, batch, 0)
    finally:
        model.generate = original  # type: ignore[method-assign]


def time_engine(model: torch.nn.Module, workload: Workload, batch: int, device: str, **options: object) -> dict:
    columns = max(len(p) + n for p, n in zip(workload.prompts, workload.lengths, strict=True))
    engine = TorchEngine(model, None, max_batch_size=batch, max_batch_tokens=batch * columns, seed=0,
                         kv_pool_columns=columns, **options)

    async def generate(tag: str, count: int | None = None) -> int:
        pairs = list(zip(workload.prompts, workload.lengths, strict=True))[:count]
        requests = [GenerateRequest(f"{tag}-{i}", prompt, SamplingParams(temperature=1.0, max_new_tokens=n,
                                                                         ignore_eos=True))
                    for i, (prompt, n) in enumerate(pairs)]
        outputs = await asyncio.gather(*(engine.generate(request) for request in requests))
        return sum(len(output[0].output_ids) for output in outputs)

    async def passes() -> dict:
        if options.get("cuda_graphs") and options.get("kv_cache") == "static":
            await generate("warm")  # every (rows, columns) bucket the timed pass meets is captured here
        else:
            await generate("warm", 8)
        _sync(device)
        steps_before = engine._batcher.steps
        started = time.perf_counter()
        tokens = await generate("timed")
        _sync(device)
        seconds = time.perf_counter() - started
        steps = engine._batcher.steps - steps_before
        await engine.close()
        decoder = getattr(engine._batcher, "decoder", None)
        return {"seconds": seconds, "tokens": tokens, "steps": steps,
                "graphs": len(decoder.graphs) if decoder is not None else 0,
                "capture_seconds": decoder.capture_seconds if decoder is not None else 0.0}

    return asyncio.run(passes())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--longest", type=int, default=256, help="the longest answer (the Pareto's cap)")
    parser.add_argument("--sides", nargs="+", default=["generate", "dynamic", "static-eager", "static-graphs"])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    from actors.runtime.logs import quiet_library_output

    quiet_library_output()
    model = build_model(args.shape, args.device)
    rows = []
    print(f"{'batch':>5}  {'side':<14} {'tokens/s':>10} {'x generate':>10} {'steps':>6} {'ms/step':>8}  notes",
          flush=True)
    for batch in args.batches:
        workload = make_workload(2 * batch, SHAPES[args.shape]["vocab_size"], args.longest, seed=batch)
        baseline = None
        for side in args.sides:
            try:
                if side == "generate":
                    seconds, tokens = time_generate(model, workload, batch, args.device)
                    figures = {"seconds": seconds, "tokens": tokens, "steps": 0}
                else:
                    options = {"dynamic": {"kv_cache": "dynamic"},
                               "static-eager": {"kv_cache": "static", "cuda_graphs": False},
                               "static-graphs": {"kv_cache": "static", "cuda_graphs": True}}[side]
                    figures = time_engine(model, workload, batch, args.device, **options)
            except Exception as error:  # one side failing must not hide the others' rows
                print(f"{batch:>5}  {side:<14} FAILED {error!r}", flush=True)
                rows.append({"batch": batch, "side": side, "failed": repr(error)})
                continue
            rate = figures["tokens"] / figures["seconds"]
            baseline = rate if side == "generate" else baseline
            speedup = rate / baseline if baseline else float("nan")
            ms_step = 1000 * figures["seconds"] / figures["steps"] if figures["steps"] else float("nan")
            notes = (f"{figures['graphs']} graphs, captured in {figures['capture_seconds']:.1f} s"
                     if figures.get("graphs") else "")
            print(f"{batch:>5}  {side:<14} {rate:>10,.0f} {speedup:>9.2f}x {figures['steps']:>6} {ms_step:>8.2f}  "
                  f"{notes}", flush=True)
            rows.append({"batch": batch, "side": side, "tokens_per_s": rate, "speedup": speedup, **figures})
    if args.json is not None:
        args.json.write_text(json.dumps({"shape": args.shape, "device": args.device, "rows": rows}, indent=2))
    return 1 if any("failed" in row for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
