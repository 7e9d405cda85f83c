"""Benchmark: a LoRA run's weight sync (the adapter alone) against a full-weight sync, measured in the same run.

    python -m tools.bench.lora            # bytes at three published model shapes, and timed syncs of a ~75M model
    python -m tools.bench.lora --quick    # the tiny model, one repeat: the smoke test
    python -m tools.bench.lora --json out.json

Bytes. What one push carries, computed from the trainer's own naming of what it sends (`engines.training.lora`)
on models built with meta tensors, so a 7B shape costs no memory: every parameter (tied ones once) for full
fine-tuning, the adapter's A and B matrices for LoRA, both in bfloat16 as `--bf16` pushes them. Target: at least
20x fewer bytes at rank 16 on a model of realistic shape.

Seconds. A real push on this machine: the learner's `TorchTrainer` (full, then LoRA) sends over the gloo
torch.distributed transfer to another process whose `TorchEngine` receives it through the rollout worker's own
loader (pause, receive, load or merge, resume), until the engine acknowledged. The full-weight push is the
baseline; both are medians over the repeats, after one untimed warm-up each.

The same two pushes into an SGLang-compatible server (`tools.standins.sglang_server`, SGLang's HTTP API over the torch
engine, in its own process): full weights as SGLang receives them (one broadcast per tensor, per
`/update_weights_from_distributed` call), and the adapter as a LoRA run on SGLang sends it (gloo to the rollout
worker, a PEFT folder, `/load_lora_adapter`; `engines/sglang/adapter_sync.py`).

The four receiving processes (two engines, two servers) are forked from the benchmark's process before it runs a
torch op, and told later over their stdin what to load and which group to join (tools/bench/forked.py): each starts
with torch and transformers imported, not as a new interpreter that imports them again.
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

from engines.training.lora import LoraSettings, adapter_tensors, wrap
from tools.bench.engine_process import Silent, forked_engine, order_pushes
from tools.bench.forked import ForkedWorker
from tools.bench.forked_server import ForkedServer
from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model

REPO = Path(__file__).resolve().parents[2]
# Published shapes (config.json values); the weights are never materialised.
SHAPES: dict[str, dict[str, Any]] = {
    "Qwen2.5-0.5B": {"family": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
                     "tie_word_embeddings": True},
    "Qwen2.5-7B": {"family": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                   "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                   "tie_word_embeddings": False},
    "Llama-3.1-8B": {"family": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                     "tie_word_embeddings": False},
}
RANKS = (16, 64)
TIMED_MODEL = TinyModelSpec(family="qwen2", hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                            num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=512)
QUICK_MODEL = TinyModelSpec()
TIMED_RANK = 16
WIRE_BYTES = 2  # bfloat16


@dataclass(frozen=True)
class BytesRow:
    model: str
    parameters: int
    rank: int
    full_mb: float
    adapter_mb: float
    fewer: float


@dataclass(frozen=True)
class SyncRow:
    update: str
    megabytes: float
    seconds: float
    mb_per_s: float


def bytes_rows(ranks: tuple[int, ...]) -> list[BytesRow]:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    rows = []
    for name, shape in SHAPES.items():
        family, settings = shape["family"], {k: v for k, v in shape.items() if k != "family"}
        config = (Qwen2Config if family == "qwen2" else LlamaConfig)(**settings)
        for rank in ranks:
            with torch.device("meta"):  # the adapter's matrices too: counted, never initialised on the CPU
                model = AutoModelForCausalLM.from_config(config)
                full = sum(parameter.numel() for _, parameter in model.named_parameters())
                adapter = sum(tensor.numel() for _, tensor in adapter_tensors(wrap(model, _settings(rank))))
            rows.append(BytesRow(name, full, rank, full * WIRE_BYTES / 1e6, adapter * WIRE_BYTES / 1e6,
                                 full / adapter))
    return rows


@dataclass(frozen=True)
class Receivers:
    """The processes the timed pushes go to, one per row, each waiting for the line that says what to receive."""

    engines: dict[str, ForkedWorker]  # full, adapter
    servers: dict[str, ForkedServer]
    scratch: Path  # the engines' errors files (engine-NAME.err), the servers' errors files and logs

    @classmethod
    def fork(cls, scratch: Path) -> Receivers:
        """Before this process's first torch op: a child forked after its OpenMP pool started would hang in its own
        first parallel region (tools/bench/forked.py), so torch runs on one thread until the last fork. What the
        workers run is imported here first, once for all of them."""
        for module in ("engines.inference", "engines.weights.torch_loader", "tools.standins.sglang_server.server"):
            importlib.import_module(module)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        updates = ("full", "adapter")
        engines = {update: forked_engine(scratch / f"engine-{update}.err") for update in updates}
        servers = {update: ForkedServer(scratch / f"server-{update}") for update in updates}
        torch.set_num_threads(threads)
        return cls(engines, servers, scratch)

    def close(self) -> None:
        for engine in self.engines.values():
            engine.kill()
        for server in self.servers.values():
            server.kill()


def sync_rows(model_path: Path, repeats: int, receivers: Receivers) -> list[SyncRow]:
    return [_timed_pushes(model_path, "full weights", None, repeats, receivers, "full"),
            _timed_pushes(model_path, f"LoRA adapter (rank {TIMED_RANK})", _settings(TIMED_RANK), repeats, receivers,
                          "adapter")]


def _settings(rank: int) -> LoraSettings:
    return LoraSettings(rank=rank, alpha=2.0 * rank)


def _timed_pushes(model_path: Path, label: str, adapter: LoraSettings | None, repeats: int, receivers: Receivers,
                  name: str) -> SyncRow:
    from engines.training import TorchTrainer, TorchTrainerConfig
    from engines.weights import TorchDistributedWeightSender

    trainer = TorchTrainer(TorchTrainerConfig(model_path=model_path, check_packing=False, lora=adapter))
    sender = TorchDistributedWeightSender(timeout_s=300)
    spec = sender.open_group(["learner", "engine-0"])
    engine = receivers.engines[name]
    order_pushes(engine, str(model_path), spec.to_dict(), adapter.scaling if adapter is not None else None,
                 repeats + 1)
    try:
        sender.wait_for_receivers()
        pushes = []
        for version in range(1, repeats + 2):  # version 1 warms up untimed
            started = time.perf_counter()
            report = sender.send(trainer.named_tensors(), version=version)
            pushes.append((time.perf_counter() - started, report.num_bytes))
        if engine.wait(timeout=120) != 0:
            errors = (receivers.scratch / f"engine-{name}.err").read_text()[-3000:]
            raise RuntimeError(f"bench lora: the torch engine of the {label!r} pushes exited with {engine.returncode}:"
                               f"\n{errors}")
        return _row(label, pushes)
    finally:
        sender.close()
        trainer.close()


def sglang_rows(model_path: Path, repeats: int, receivers: Receivers) -> list[SyncRow]:
    return [asyncio.run(_timed_sglang_pushes(model_path, "full weights", None, repeats, receivers.servers["full"])),
            asyncio.run(_timed_sglang_pushes(model_path, f"LoRA adapter (rank {TIMED_RANK})", _settings(TIMED_RANK),
                                             repeats, receivers.servers["adapter"]))]


async def _timed_sglang_pushes(model_path: Path, label: str, adapter: LoraSettings | None, repeats: int,
                               server: ForkedServer) -> SyncRow:
    from engines.sglang.adapter_endpoints import AdapterServing
    from engines.sglang.client import SglangEngine
    from engines.training import TorchTrainer, TorchTrainerConfig
    from engines.weights.transport import SGLANG, SGLANG_LORA, SenderOptions, resolve_transport

    trainer = TorchTrainer(TorchTrainerConfig(model_path=model_path, check_packing=False, lora=adapter))
    extra: dict[str, str | list[str]] = {"torch-threads": "1", "weight-group-timeout": "300"}
    if adapter is not None:
        extra |= {"enable-lora": "true", "max-lora-rank": str(adapter.rank), "lora-target-modules": ["all"]}
    url = await asyncio.to_thread(server.start, model_path, extra)
    try:
        client = SglangEngine(url, adapters=AdapterServing(adapter.alpha) if adapter is not None else None)
        transport = resolve_transport(SGLANG if adapter is None else SGLANG_LORA)
        sender = transport.make_sender(SenderOptions(host="127.0.0.1", backend="gloo", timeout_s=300.0))
        loader = transport.make_loader(client, "engine-0", Silent())
        group = sender.open_group(["learner", "engine-0"]).to_dict()
        try:
            pushes = []
            for version in range(1, repeats + 2):  # version 1 joins the group and warms up, untimed
                started = time.perf_counter()
                receiving = asyncio.create_task(loader.apply(group, version, 300.0))
                if version == 1:
                    await asyncio.to_thread(sender.wait_for_receivers)
                report = await asyncio.to_thread(sender.send, trainer.named_tensors(), version)
                await receiving
                pushes.append((time.perf_counter() - started, report.num_bytes))
            return _row(label, pushes)
        finally:
            loader.close()
            sender.close()
            await client.close()
    finally:
        server.stop()
        trainer.close()


def _row(label: str, pushes: list[tuple[float, int]]) -> SyncRow:
    """The median of (seconds, bytes) pushes, the first (the warm-up) left out."""
    median = statistics.median(seconds for seconds, _ in pushes[1:])
    megabytes = pushes[-1][1] / 1e6
    return SyncRow(label, megabytes, median, megabytes / median)


def print_sync_table(title: str, rows: list[SyncRow]) -> None:
    print(title)
    header = f"{'update':<26}{'MB':>9}{'seconds':>10}{'MB/s':>9}{'vs full':>10}"
    print(header)
    print("-" * len(header))
    baseline = rows[0].seconds
    for row in rows:
        print(f"{row.update:<26}{row.megabytes:>9.1f}{row.seconds:>10.3f}{row.mb_per_s:>9.0f}"
              f"{baseline / row.seconds:>9.1f}x")


def print_tables(
    byte_rows: list[BytesRow], timed: list[SyncRow], sglang: list[SyncRow], timed_parameters: int
) -> None:
    print("\nbytes per weight push (bfloat16 on the wire), full fine-tuning vs LoRA on all linear layers")
    header = f"{'model':<14}{'params':>9}{'rank':>6}{'full MB':>11}{'adapter MB':>12}{'fewer bytes':>13}"
    print(header)
    print("-" * len(header))
    for row in byte_rows:
        print(f"{row.model:<14}{row.parameters / 1e9:>8.2f}B{row.rank:>6}{row.full_mb:>11.0f}{row.adapter_mb:>12.1f}"
              f"{row.fewer:>12.0f}x")
    print("target: at least 20x fewer bytes at rank 16 on a model of realistic shape")
    size = f"{timed_parameters / 1e6:.1f}M-parameter model (float32, medians); baseline: the full-weight push"
    print_sync_table(f"\none push, learner -> torch engine over gloo, {size}", timed)
    print_sync_table(f"\none push, learner -> SGLang-compatible server, {size}", sglang)
    print("on one machine the bytes move at memory speed: the torch engine's adapter push is bound by folding it into "
          "its weights\n(one pass over each adapted layer), the server's by writing and reading the adapter folder "
          "(it merges at the first\nrequest that names the adapter); between machines the bytes are what a push costs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the tiny model and one repeat: a smoke run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    from actors.runtime.logs import quiet_library_output

    quiet_library_output()
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as scratch:
        receivers = Receivers.fork(Path(scratch))
        try:
            spec = QUICK_MODEL if args.quick else TIMED_MODEL
            model_path = cached_tiny_model(REPO / ".cache" / "models", spec)
            parameters = sum(p.numel() for p in _load(model_path).parameters())
            byte_rows = bytes_rows(RANKS[:1] if args.quick else RANKS)
            timed = sync_rows(model_path, 1 if args.quick else args.repeats, receivers)
            sglang = sglang_rows(model_path, 1 if args.quick else args.repeats, receivers)
        finally:
            receivers.close()
    print_tables(byte_rows, timed, sglang, parameters)
    if args.json is not None:
        args.json.write_text(json.dumps({"bytes": [asdict(row) for row in byte_rows],
                                         "sync": [asdict(row) for row in timed],
                                         "sglang": [asdict(row) for row in sglang]}, indent=2))


def _load(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


if __name__ == "__main__":
    main()
