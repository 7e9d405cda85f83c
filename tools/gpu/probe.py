"""What this machine's torch can do for the GPU paths, in under a minute: the facts the engine and trainer designs
depend on, read on the device instead of from documentation.

    python -m tools.gpu.probe [--json PATH]     # on a GPU machine
    python -m tools.gpu.probe --cpu             # the same probes where they can run on a CPU (CI: cannot rot)

Each line is one probe: versions; `torch.nn.attention.varlen.varlen_attn` (its signature, GQA, forward and
backward against SDPA); host syncs of one decode step of each KV layout (`torch.cuda.set_sync_debug_mode`);
one decode step captured as a CUDA graph and replayed; cuBLAS row invariance of a bf16 matmul at the real model's
inner sizes (a row's result alone and inside a batch of 32..256 rows).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import torch


def probe_versions(device: str) -> str:
    parts = [f"torch {torch.__version__}", f"cuda {torch.version.cuda}"]
    for name in ("triton", "transformers"):
        try:
            parts.append(f"{name} {importlib.import_module(name).__version__}")
        except ImportError:
            parts.append(f"{name} absent")
    if device == "cuda":
        parts.append(torch.cuda.get_device_name())
    return ", ".join(parts)


def probe_varlen(device: str) -> str:
    """Two packed sequences through varlen_attn against SDPA per sequence, GQA (4 query heads per KV head)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as error:
        return f"absent ({error})"
    signature = str(inspect.signature(varlen_attn))
    if device != "cuda":
        return f"present, CUDA only; signature {signature}"
    lengths, heads, kv_heads, dim = [37, 91], 8, 2, 64
    total = sum(lengths)
    generator = torch.Generator(device="cuda").manual_seed(0)

    def tensor(h: int) -> torch.Tensor:
        return torch.randn(total, h, dim, device="cuda", dtype=torch.bfloat16, generator=generator).requires_grad_()

    q, k, v = tensor(heads), tensor(kv_heads), tensor(kv_heads)
    cu = torch.tensor([0, lengths[0], total], dtype=torch.int32, device="cuda")
    notes = []
    parameters = inspect.signature(varlen_attn).parameters
    kwargs: dict[str, object] = {}
    if "is_causal" in parameters:
        kwargs["is_causal"] = True
    elif "window_size" in parameters:
        kwargs["window_size"] = (-1, 0)
    if "enable_gqa" in parameters:
        kwargs["enable_gqa"] = True
    try:
        out = varlen_attn(q, k, v, cu, cu, max(lengths), max(lengths), **kwargs)
    except Exception as error:  # GQA refused: try with the KV heads repeated
        notes.append(f"GQA refused ({type(error).__name__}: {str(error)[:120]}), KV heads repeated")
        kwargs.pop("enable_gqa", None)
        group = heads // kv_heads
        out = varlen_attn(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), cu, cu, max(lengths),
                          max(lengths), **kwargs)
    out.float().square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    reference = []
    for start, length in zip([0, lengths[0]], lengths, strict=True):
        pieces = [t[start : start + length].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        reference.append(torch.nn.functional.scaled_dot_product_attention(
            *pieces, is_causal=True, enable_gqa=True).squeeze(0).transpose(0, 1))
    expected = torch.cat(reference)
    expected.float().square().sum().backward()
    forward_error = float((out.detach().float() - expected.detach().float()).abs().max())
    backward_error = max(float((g - t.grad).float().abs().max()) for g, t in zip(grads, (q, k, v), strict=True))
    return (f"forward max|diff| {forward_error:.3g}, backward {backward_error:.3g} vs SDPA (bf16); kwargs "
            f"{sorted(kwargs)}; {'; '.join(notes) or 'GQA native'}; signature {signature}")


def probe_decode_steps(device: str) -> str:
    """Host syncs of one steady decode step of each KV layout, and a CUDA-graph replay of the static one."""
    import asyncio

    from engines.inference import GenerateRequest, SamplingParams, TorchEngine
    from tools.bench.engine_gpu import build_model

    model = build_model("tiny", device)
    parts = []
    for layout in ("dynamic", "static"):
        engine = TorchEngine(model, None, kv_cache=layout, max_batch_size=8, kv_pool_columns=256, seed=0)
        syncs: list[int] = []

        def count(record: object, syncs: list[int] = syncs) -> None:
            syncs.append(0)

        params = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True)
        requests = [GenerateRequest(f"{layout}-{i}", [5 + i] * (10 + i), params) for i in range(8)]

        async def generate(engine: TorchEngine = engine, requests: list = requests) -> None:
            await asyncio.gather(*(engine.generate(r) for r in requests))
            await engine.close()

        if device == "cuda":
            warnings.simplefilter("always")
            with warnings.catch_warnings(record=True) as caught:
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    asyncio.run(generate())
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            steps = max(1, 24)
            found = [w for w in caught if "synchroniz" in str(w.message)]
            parts.append(f"{layout}: {len(found) / steps:.1f} syncs/step ({len(found)} in {steps} steps)")
        else:
            asyncio.run(generate())
            parts.append(f"{layout}: ran (sync counts need CUDA)")
        if layout == "static" and device == "cuda":
            graphs = engine._batcher.decoder.graphs
            parts.append(f"static: {len(graphs)} graphs captured in {engine._batcher.decoder.capture_seconds:.2f} s")
    return "; ".join(parts)


def probe_cublas_rows(device: str) -> str:
    """Whether a row's product is bit-identical alone (padded to 32 rows) and inside a larger batch, at K=896/4864."""
    if device != "cuda":
        return "needs CUDA"
    generator = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for inner, outer in ((896, 4864), (4864, 896), (896, 151936)):
        weight = torch.randn(outer, inner, device="cuda", dtype=torch.bfloat16, generator=generator)
        rows = torch.randn(256, inner, device="cuda", dtype=torch.bfloat16, generator=generator)
        alone = rows[:32] @ weight.T
        same = all(torch.equal((rows[:m] @ weight.T)[:32], alone) for m in (32, 64, 128, 256))
        results.append(f"K={inner} N={outer}: {'invariant' if same else 'VARIES'}")
    return ", ".join(results)


PROBES: dict[str, Callable[[str], str]] = {
    "versions": probe_versions,
    "varlen_attn": probe_varlen,
    "decode step": probe_decode_steps,
    "cuBLAS rows": probe_cublas_rows,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    from actors.runtime.logs import quiet_library_output

    quiet_library_output()
    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("gpu_probe: no CUDA device here; use --cpu")
    device = "cpu" if args.cpu else "cuda"
    results, failed = {}, False
    for name, probe in PROBES.items():
        started = time.monotonic()
        try:
            result = probe(device)
        except Exception as error:
            failed = True
            result = f"FAILED {error!r}\n{traceback.format_exc()[-1500:]}"
        results[name] = result
        print(f"probe {name} ({time.monotonic() - started:.1f} s): {result}", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
