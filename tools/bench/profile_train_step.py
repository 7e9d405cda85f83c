"""Where a torch-trainer step spends its time against a bare HF step: torch.profiler tables for both.

    python -m tools.bench.profile_train_step          # CUDA when present, else the CPU; gpu_check's model and batch
    python -m tools.bench.profile_train_step --quick --out DIR

`tools/gpu/check.py` reports the ratio of the two steps; this says why it is what it is. It profiles each step
(after a warm-up) and prints, per step: wall time, the time the device was busy (kernels' self time), and the
operators that take the most self time, so a gap shows up as either extra kernels or host time between them.
`--out DIR` also writes both tables and a Chrome trace per step.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

from tools.gpu.check import train_steps


def profile(name: str, step: Callable[[], None], device: str, out: Path | None) -> str:
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    step()
    step()  # warm-up: allocator, autotuning, lazy inits
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch_profile(activities=activities, record_shapes=False) as prof:
        started = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - started
    events = prof.key_averages()
    sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    # Kernels only: an operator's self device time is its kernels' time again.
    busy_us = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA)
    table = events.table(sort_by=sort, row_limit=25, max_name_column_width=60)
    header = f"## {name}: {wall * 1000:.1f} ms wall (profiled)"
    if device == "cuda":
        header += f", kernels {busy_us / 1000:.1f} ms"
    if out is not None:
        slug = name.replace(" ", "_")
        (out / f"{slug}.txt").write_text(header + "\n" + table)
        prof.export_chrome_trace(str(out / f"{slug}.trace.json"))
    return header + "\n" + table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the small model and batch (CPU-sized)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    parser.add_argument("--out", type=Path, default=None, help="folder for the tables and Chrome traces")
    args = parser.parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    steps = train_steps(device, args.quick)
    try:
        for name, step in (("torch trainer", steps.ours), ("bare HF", steps.bare)):
            print(profile(name, step, device, args.out), flush=True)
    finally:
        steps.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
