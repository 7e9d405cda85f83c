"""Benchmark: a weight push to a colocated SGLang server by reference, against the broadcast path it replaces.

    python -m tools.bench.sglang_colocate              # ~100M-parameter Qwen2-shaped model, fp32 and bf16 pushes
    python -m tools.bench.sglang_colocate --quick      # a small model, one repeat: a smoke run
    python -m tools.bench.sglang_colocate --json out.json

One SGLang-compatible server (`tools.standins.sglang_server`, its own process) serves the model; this process is the
learner and its rollout worker. Each repeat pushes the same weights twice, alternating:
* broadcast (the baseline): `SglangWeightSender` over gloo, the server joining the group and receiving one
  broadcast per tensor per `/update_weights_from_distributed` call, as a server on its own GPU does;
* by reference: `SglangTensorSender`, the colocated path, where each bucket is copied once into shared memory
  and the server opens it by name through `/update_weights_from_tensor` (CUDA IPC handles on a GPU).
Both load the weights into the server's model, and both end at the server's acknowledgement. Times are medians;
ref/broadcast is the median over repeats of each adjacent pair's ratio. On a GPU the broadcast path cannot serve
a colocated server at all (NCCL refuses two ranks on one device): this measures what the CPU stand-in can show,
the cost of moving bytes through a socket against handing the server the learner's memory.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from engines.sglang.client import SglangEngine
from engines.sglang.tensor_weights import SglangTensorLoader, SglangTensorSender
from engines.sglang.weights import SglangWeightLoader, SglangWeightSender
from engines.weights.base import TransferReport, WeightSender
from tools.bench.forked_server import ForkedServer
from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model

FULL = TinyModelSpec(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                     num_key_value_heads=4)
QUICK = TinyModelSpec(hidden_size=128, intermediate_size=352, num_hidden_layers=2)
ENGINE = "rollout-0-0"
DTYPES = {"fp32": None, "bf16": torch.bfloat16}  # what travels; the server serves float32 and casts on load


@dataclass
class PushPath:
    """One way into the server: a sender and the loader that drives the server for it, its group formed once."""

    sender: WeightSender
    loader: Any
    spec: Any = None

    async def push(self, weights: list[tuple[str, torch.Tensor]], version: int,
                   dtype: torch.dtype | None) -> TransferReport:
        first = self.spec is None
        if first:
            self.spec = self.sender.open_group(["learner", ENGINE])
        receiving = asyncio.create_task(self.loader.apply(self.spec.to_dict(), version, 300.0))
        try:
            if first:
                await asyncio.to_thread(self.sender.wait_for_receivers)
            return await asyncio.to_thread(self.sender.send, weights, version, dtype=dtype)
        finally:
            await receiving


@dataclass(frozen=True)
class Row:
    dtype: str
    megabytes: float
    broadcast_seconds: float
    reference_seconds: float
    ratio: float  # reference / broadcast: below 1 is faster


def main() -> None:
    args = _parse_args()
    spec = QUICK if args.quick else FULL
    repeats = 1 if args.quick else args.repeats
    with tempfile.TemporaryDirectory(prefix="bench-sglang-colocate-") as scratch:
        # Forked before this process's first torch op (tools/bench/forked.py), with the server's modules imported.
        importlib.import_module("tools.standins.sglang_server.server")
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        server = ForkedServer(Path(scratch) / "server")
        torch.set_num_threads(threads)
        try:
            model = cached_tiny_model(Path(tempfile.gettempdir()) / "slipstream-bench-models", spec)
            url = server.start(model, {"torch-threads": "1", "weight-group-timeout": "120"})
            rows = asyncio.run(_measure(url, model, args.dtypes.split(","), repeats))
        finally:
            server.stop()
    _print_table(rows, repeats)
    if args.json:
        Path(args.json).write_text(json.dumps({"model": str(model), "rows": [asdict(r) for r in rows]}, indent=2))


async def _measure(url: str, model: Path, dtypes: list[str], repeats: int) -> list[Row]:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()

    weights = [(name, tensor.detach()) for name, tensor in
               AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).state_dict().items()]
    client = SglangEngine(url, control_timeout=300)
    paths = {
        "broadcast": PushPath(SglangWeightSender(host="127.0.0.1", backend="gloo", timeout_s=300),
                              SglangWeightLoader(client, ENGINE)),
        "reference": PushPath(SglangTensorSender(host="127.0.0.1", timeout_s=300), SglangTensorLoader(client, ENGINE)),
    }
    rows, version = [], 0
    try:
        for dtype_name in dtypes:
            dtype = DTYPES[dtype_name]
            seconds: dict[str, list[float]] = {"broadcast": [], "reference": []}
            for _ in range(repeats + 1):  # the first round forms the groups and warms both paths: not counted
                for name, path in paths.items():
                    version += 1
                    started = time.perf_counter()
                    report = await path.push(weights, version, dtype)
                    seconds[name].append(time.perf_counter() - started)
            pairs = list(zip(seconds["broadcast"][1:], seconds["reference"][1:], strict=True))
            rows.append(Row(dtype_name, report.num_bytes / 1e6, statistics.median(seconds["broadcast"][1:]),
                            statistics.median(seconds["reference"][1:]),
                            statistics.median(reference / broadcast for broadcast, reference in pairs)))
    finally:
        for path in paths.values():
            path.sender.close()
        await client.close()
    return rows


def _print_table(rows: list[Row], repeats: int) -> None:
    header = f"{'push':<8}{'MB':>9}{'broadcast s':>13}{'by reference s':>16}{'ref/broadcast':>15}"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{row.dtype:<8}{row.megabytes:>9.1f}{row.broadcast_seconds:>13.3f}{row.reference_seconds:>16.3f}"
              f"{row.ratio:>14.0%}")
    print(f"medians of {repeats} alternating repeats into one SGLang-compatible server, each ending at its "
          "acknowledgement; baseline: the gloo broadcast path (/update_weights_from_distributed)")


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small model, one repeat: a smoke run")
    parser.add_argument("--dtypes", default="fp32,bf16", help=f"comma-separated pushes among {', '.join(DTYPES)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the figures to this path")
    return parser.parse_args()


if __name__ == "__main__":
    main()
