"""One command for a GPU machine: does Slipstream's GPU path work here, and how fast is it?

    python -m tools.gpu.check [--wheels DIR] [--json PATH] [--quick]
    python -m tools.gpu.check --cpu --quick        # the same checks on the CPU (CI runs this, so it cannot rot)

Made for a machine with a GPU and no internet: `--wheels DIR` first installs a folder of wheels (`pip install
--no-index --no-deps`) into `.cache/gpu-check-site`, for the packages the machine lacks. Then it runs, in order,
and prints one table:

1. `pytest -m gpu` (with --cpu: only collected, since every one of them needs CUDA);
2. a short fully-async run through `launcher.py`: torch engine and torch trainer sharing one GPU (two rollout
   workers on the learner's device, weights over CUDA IPC);
3. the same run with `--train-backend megatron` (TP=1), when megatron-core is installed;
3b. a colocated LoRA run (`--colocate --lora-rank 8`): on-policy turns on the learner's device, the adapter pushed
   alone (CUDA IPC on a GPU, shared memory on CPUs), the learner's optimizer state offloaded between steps;
3c. one Megatron train step on packed rows (THD) against padded rows, same batch (`tools/bench/megatron_packing.py`);
4. the torch engine's tokens/s against HF `generate()` on the same device and model, same workload;
5. one train step of the torch trainer against a bare HF forward + backward + AdamW step on the same batch;
6. one weight sync through the transport a run would use (CUDA IPC on one GPU, gloo on the CPU) against a raw
   copy (GPU) or raw gloo broadcast (CPU) of the same bytes.

Every row says ok / FAILED / skipped and why; the exit code is 1 if any row failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SITE = REPO / ".cache" / "gpu-check-site"


@dataclass
class Row:
    """One row of the table."""

    check: str
    status: str  # ok / FAILED / skipped
    result: str
    baseline: str = ""
    seconds: float = 0.0


def install_wheels(folder: Path) -> None:
    """Install a folder of wheels into SITE and put it first on this process's and the children's path."""
    wheels = sorted(str(path) for path in folder.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"--wheels {folder}: no .whl files there")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--upgrade", "--target", str(SITE), *wheels], check=True)
    sys.path.insert(0, str(SITE))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(SITE), str(REPO), os.environ.get("PYTHONPATH", "")])


# --------------------------------------------------------------------------------------------------- checks
# The rows that run something whole in its own process: a short run through the launcher per training backend
# (and a colocated LoRA run), and the Megatron step benchmark.

# check -> (row name, the run's own flags): a fully-async run per training backend, and a colocated LoRA run (the
# engines on the learner's device taking turns, the adapter pushed alone: CUDA IPC on a GPU, shared memory on CPUs).
RUNS = {
    "torch": ("run: torch engine + torch trainer", ["--train-backend", "torch", "--max-staleness", "1"]),
    "megatron": ("run: megatron TP=1", ["--train-backend", "megatron", "--max-staleness", "1"]),
    "colocate": ("run: colocated, LoRA adapter", ["--train-backend", "torch", "--colocate", "--lora-rank", "8",
                                                   "--lora-alpha", "16"]),
}


def check_run(variant: str, cpu: bool, quick: bool, workdir: Path) -> Row:
    """A short run through the launcher; ok if it exits 0 having trained every step."""
    name, flags = RUNS[variant]
    if variant == "megatron" and (missing := _megatron_missing()):
        return Row(name, "skipped", missing)
    from tools.make_arithmetic_data import make_arithmetic_data
    from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model

    model = cached_tiny_model(REPO / ".cache" / "models", TinyModelSpec(family="qwen2", max_position_embeddings=64))
    data = make_arithmetic_data(workdir / "data", max_operand=9, eval_size=10, sft_size=20)
    steps = 4 if quick else 12
    run_dir = workdir / f"run-{variant}"
    command = [sys.executable, "launcher.py", "--head", "--run-dir", str(run_dir), "--hf-checkpoint", str(model),
               "--prompt-data", str(data["train"]), *flags, "--num-rollout", str(steps),
               "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "4",
               "--rollout-workers", "2", "--reward-workers", "1", "--lr", "1e-4",
               "--rm-type", "exact_match", "--no-progress", "--no-use-tensorboard", "--no-plots",
               "--final-eval-timeout", "0", "--weight-transfer-timeout", "60"]
    env = dict(os.environ)
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    started = time.monotonic()
    completed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900, env=env,
                               check=False)
    seconds = time.monotonic() - started
    transport = _effective(run_dir, "weights", "weight_transport")
    trained = _trained_steps(run_dir)
    placement = next((line for line in completed.stderr.splitlines() if line.startswith("placement")), "")
    counters = _learner_counters(run_dir)
    summary = (f"{trained}/{steps} steps in {seconds:.0f}s, weights over {transport} "
               f"({counters.get('weights.pushed', 0)} pushes, {counters.get('weights.pushed_beside_step', 0)} "
               "beside a step)")
    if placement:
        summary += f"; {placement}"
    if completed.returncode != 0 or trained < steps:
        return Row(name, "FAILED", f"exit {completed.returncode}, {summary}\n{completed.stderr[-1500:]}",
                   seconds=seconds)
    return Row(name, "ok", summary, seconds=seconds)


def check_megatron_step(cpu: bool, quick: bool, workdir: Path) -> Row:
    """One Megatron train step on packed rows (THD, the default) against padded rows: `bench_megatron_packing`,
    in its own process (a megatron world of its own, torn down with it)."""
    if missing := _megatron_missing():
        return Row(MEGATRON_STEP, "skipped", missing)
    out = workdir / "megatron-step.json"
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if cpu else {})}
    completed = subprocess.run(megatron_step_command(out, quick), cwd=REPO, capture_output=True, text=True,
                               timeout=600, env=env, check=False)
    if completed.returncode != 0 or not out.exists():
        return Row(MEGATRON_STEP, "FAILED", f"exit {completed.returncode}\n{completed.stderr[-1500:]}")
    return megatron_step_row(out)


MEGATRON_STEP = "megatron step: packed (thd) vs padded rows"


def megatron_step_command(out: Path, quick: bool) -> list[str]:
    """The benchmark the row runs; CI runs the quick one once, in tests/tools/test_bench_megatron_packing.py."""
    return [sys.executable, "-m", "tools.bench.megatron_packing", "--json", str(out),
            *(["--quick"] if quick else ["--repeats", "3"])]


def megatron_step_row(out: Path) -> Row:
    """The row from the rows the benchmark wrote to `out`."""
    rows = {row["layout"]: row for row in json.loads(out.read_text(encoding="utf-8"))["rows"]}
    packed, padded = rows["thd"], rows["bshd"]
    return Row(MEGATRON_STEP, "ok", f"{packed['seconds'] * 1000:.1f} ms ({packed['speedup']:.2f}x the padded rows' "
               f"tokens/s), {padded['padded_fraction']:.0%} of padded slots were padding",
               f"{padded['seconds'] * 1000:.1f} ms")


def _megatron_missing() -> str:
    """Why a Megatron row cannot run here, or "" when it can."""
    try:
        with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed", once per module: the
            warnings.simplefilter("ignore")  # table's header says whether they are
            import megatron.core  # noqa: F401
    except ImportError as error:
        return f"megatron-core not installed ({error})"
    return ""


def _effective(run_dir: Path, section: str, key: str) -> str:
    """A setting as the run recorded it (RUN_DIR/config.yaml is written by section)."""
    import yaml

    path = run_dir / "config.yaml"
    return str(yaml.safe_load(path.read_text()).get(section, {}).get(key)) if path.exists() else "?"


def _trained_steps(run_dir: Path) -> int:
    path = run_dir / "metrics" / "train.jsonl"
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if line.strip())


def _learner_counters(run_dir: Path) -> dict[str, int]:
    """The learner's counters from its "actor stopped" log line: whether pushes ran beside a step shows there."""
    path = run_dir / "logs" / "learner.jsonl"
    if not path.exists():
        return {}
    for line in reversed(path.read_text().splitlines()):
        if '"actor stopped"' in line:
            return json.loads(line).get("counters", {})
    return {}


GPU_TEST_FILES = "tests/**/test_*_gpu.py"  # where `gpu` tests live (tests/test_architecture.py keeps them there)


def check_gpu_tests(cpu: bool, quick: bool) -> Row:
    # Only the GPU test files: collecting the whole suite would import every CPU test's dependencies for nothing.
    files = sorted(str(path.relative_to(REPO)) for path in REPO.glob(GPU_TEST_FILES))
    options = ["-m", "gpu", "-q", "-p", "no:cacheprovider", *files]
    if cpu:
        returncode, output = _collect_here(options)
        tail = output.strip().splitlines()[-1] if output.strip() else f"pytest exited {returncode}, printing nothing"
        collected = re.search(r"(\d+)(?:/\d+)? tests? collected", tail)
        ok = returncode == 0 and collected is not None
        detail = tail if ok else tail + "\n" + output[-1500:]
        return Row("pytest -m gpu", "ok" if ok else "FAILED", f"collected only (no CUDA): {detail}")
    command = [sys.executable, "-m", "pytest", *options]
    completed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1200, check=False)
    tail = completed.stdout.strip().splitlines()[-1] if completed.stdout.strip() else completed.stderr[-300:]
    failed = re.search(r"(\d+) (failed|error)", tail)
    ok = completed.returncode == 0 and failed is None
    detail = tail if ok else tail + "\n" + _failures(completed.stdout)
    return Row("pytest -m gpu", "ok" if ok else "FAILED", detail)


def _collect_here(options: list[str]) -> tuple[int, str]:
    """`pytest --collect-only` in this process: the test modules import torch, transformers and megatron-core,
    which the later rows import here anyway, so a child of its own would pay for them twice."""
    import contextlib
    import io

    import pytest

    output = io.StringIO()
    cwd = Path.cwd()
    os.chdir(REPO)  # the files are named from the repository's root, and its pyproject.toml configures pytest
    try:
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            returncode = pytest.main(["--collect-only", *options])
    finally:
        os.chdir(cwd)
    return int(returncode), output.getvalue()


def check_engine_speed(device: str, quick: bool) -> Row:
    import asyncio

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engines.inference import TorchEngine
    from tools.bench.engine import Workload, _engine_pass, make_workload, run_baseline
    from tools.standins.tiny_model import cached_tiny_model

    spec = gpu_model_spec(device, quick)
    path = cached_tiny_model(REPO / ".cache" / "models", spec)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    workload = make_workload(tokenizer, 16 if quick else 128, 32 if quick else 256, seed=0)  # quick: one batch
    batch = 16 if quick else 64
    engine = TorchEngine(model, tokenizer, max_batch_size=batch, seed=0)
    warm = Workload(workload.prompts[:4], [4] * 4)
    with _on_device(device, model):
        run_baseline(model, warm, batch, tokenizer.pad_token_id)
        base_seconds, base_tokens = run_baseline(model, workload, batch, tokenizer.pad_token_id)
    asyncio.run(_engine_pass(engine, warm, "warm"))
    _sync(device)
    started = time.perf_counter()
    tokens = asyncio.run(_engine_pass(engine, workload, "timed"))
    _sync(device)
    seconds = time.perf_counter() - started
    asyncio.run(engine.close())
    engine_rate, base_rate = tokens / seconds, base_tokens / base_seconds
    return Row("engine tokens/s vs HF generate()", "ok",
               f"{engine_rate:,.0f} tok/s ({engine_rate / base_rate:.2f}x), batch {batch}, {spec.hidden_size}h x "
               f"{spec.num_hidden_layers}L", f"{base_rate:,.0f} tok/s", seconds)


@dataclass
class TrainSteps:
    """One torch-trainer step and one bare HF forward + backward + AdamW step on the same model and batch (also
    `tools/bench/profile_train_step.py`, which says where the difference goes)."""

    ours: Callable[[], Any]
    bare: Callable[[], Any]
    close: Callable[[], None]
    shape: str


def train_steps(device: str, quick: bool, shape: str | None = None) -> TrainSteps:
    """`shape`: a benchmark model of `tools/bench/models.py` (qwen2.5-0.5b: the real shape, random weights built
    once in `.cache/models`) instead of the check's own small model; then 16 x 512 tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    from engines.training import TorchTrainer, TorchTrainerConfig
    from tools.standins.tiny_model import TinyModelSpec, cached_tiny_model

    if shape is None:
        spec: TinyModelSpec = gpu_model_spec(device, quick)
        path = cached_tiny_model(REPO / ".cache" / "models", spec)
        count, length = (8, 32) if quick else (64, 256)  # quick: a smoke run of both steps, not a timing
    else:
        from tools.bench.models import bench_model

        path = bench_model(shape)
        count, length = (4, 64) if quick else (16, 512)
    samples, loss_fn = synthetic_step(count, length)
    dtype = "bfloat16" if device == "cuda" else "float32"
    trainer = TorchTrainer(TorchTrainerConfig(model_path=path, lr=1e-5, device=device, dtype=dtype,
                                              micro_batch_tokens=count * length, check_packing=False))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    tokens = torch.stack([s.tokens for s in samples]).to(device)

    def bare_step() -> None:
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
            logits = model(tokens).logits.float()
        loss = torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None]).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return TrainSteps(ours=lambda: trainer.train_step(samples, loss_fn, temperature=1.0), bare=bare_step,
                      close=trainer.close, shape=f"{count} x {length} tokens, {dtype}")


def check_train_step(device: str, quick: bool, shape: str | None = None) -> Row:
    steps = train_steps(device, quick, shape)
    repeats = 1 if quick else 3  # quick: a smoke run, each side warmed up and timed once
    try:
        steps.ours()  # warm-up
        ours = _timed(device, steps.ours, repeats=repeats)
        steps.bare()
        bare = _timed(device, steps.bare, repeats=repeats)
    finally:
        steps.close()
    return Row("train step: torch trainer vs bare HF+AdamW", "ok",
               f"{ours * 1000:.1f} ms ({ours / bare:.2f}x), {steps.shape}", f"{bare * 1000:.1f} ms", ours)


def check_weight_sync(device: str, quick: bool) -> Row:
    import torch

    from engines.weights import TorchDistributedWeightSender

    transport = "cuda_ipc" if device == "cuda" else "gloo"
    wire = torch.bfloat16 if device == "cuda" else torch.float32
    total = (64 if quick else 1024) * 2**20 if device == "cuda" else (16 if quick else 128) * 2**20
    shapes = _sync_shapes(total // wire.itemsize)
    tensors = [(f"layer{i}.weight", torch.randn(shape, dtype=torch.float32, device=device).to(wire))
               for i, shape in enumerate(shapes)]
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    sender = TorchDistributedWeightSender(backend=transport, device=device, timeout_s=120)
    spec = sender.open_group(["learner", "engine-0"])
    context = mp.get_context("spawn")
    results = context.Queue()
    receiver = context.Process(target=_sync_receiver, args=(spec.to_dict(), device, [list(s) for s in shapes],
                                                             str(wire).removeprefix("torch."), results), daemon=True)
    receiver.start()
    try:
        sender.wait_for_receivers()
        sender.send(tensors, version=1)  # warm-up: buffers, handles
        reports = [sender.send(tensors, version=2 + i) for i in range(3)]
        seconds = min(report.seconds for report in reports)
        ok = results.get(timeout=120)
    finally:
        receiver.join(timeout=60)
        sender.close()
    raw = _raw_copy_seconds(device, nbytes)
    status = "ok" if ok == "ok" else "FAILED"
    return Row(f"weight sync ({transport}) vs raw {'D2D copy' if device == 'cuda' else 'memcpy'}", status,
               f"{seconds:.3f} s, {nbytes / seconds / 1e9:.1f} GB/s for {nbytes / 1e9:.2f} GB ({ok})",
               f"{raw:.3f} s, {nbytes / raw / 1e9:.1f} GB/s", seconds)


def _sync_receiver(spec_dict: dict, device: str, shapes: list[list[int]], dtype_name: str, results: Any) -> None:
    import torch

    from engines.weights import GroupSpec, TorchDistributedWeightReceiver

    try:
        receiver = TorchDistributedWeightReceiver.join(GroupSpec.from_dict(spec_dict), "engine-0", timeout_s=120,
                                                       device=device)
        live = {f"layer{i}.weight": torch.zeros(shape, dtype=getattr(torch, dtype_name), device=device)
                for i, shape in enumerate(shapes)}

        def load(items: Any) -> None:
            for name, tensor in items:
                live[name].copy_(tensor)

        for _ in range(4):
            receiver.receive(load, timeout=120, destinations=live)
        receiver.close()
        results.put("ok" if all(bool(t.abs().sum() > 0) for t in live.values()) else "received zeros")
    except Exception as error:  # reported in the table, not lost in a child's stderr
        results.put(f"receiver failed: {error!r}")


# -------------------------------------------------------------------------------------------------- helpers
def synthetic_step(count: int, length: int) -> tuple[list[Any], Callable[[Any, Any], tuple[Any, dict]]]:
    """`count` random samples of `length` tokens, the second half a response with random advantages, and a
    policy-gradient loss over them: a train step's work without a rollout (also `tools/bench/colocate.py`)."""
    import torch

    from engines.training import TrainSample

    generator = torch.Generator().manual_seed(0)
    half = length // 2
    samples = [TrainSample(torch.randint(6, 100, (length,), generator=generator), half,
                           advantages=torch.randn(half, generator=generator)) for _ in range(count)]
    loss_tokens = count * half  # the whole step's count: the loss carries its own denominator

    def loss_fn(outputs: Any, batch: Any) -> tuple[Any, dict]:
        return -(batch.advantages * outputs.log_probs).sum() / loss_tokens, {}

    return samples, loss_fn


def gpu_model_spec(device: str, quick: bool) -> Any:
    from tools.standins.tiny_model import TinyModelSpec

    if device == "cuda" and not quick:
        return TinyModelSpec(family="qwen2", hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                             num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048)
    return TinyModelSpec(family="qwen2", hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)


def _sync_shapes(numel: int) -> list[tuple[int, ...]]:
    """A model-like mix: a few large matrices and many small vectors."""
    large = numel // 8
    shapes: list[tuple[int, ...]] = [(large // 1024, 1024) for _ in range(7)]
    shapes += [(1024,) for _ in range(64)]
    return shapes


def _raw_copy_seconds(device: str, nbytes: int) -> float:
    import torch

    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    return _timed(device, lambda: target.copy_(source), repeats=5)


def _timed(device: str, function: Callable[[], Any], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        started = time.perf_counter()
        function()
        _sync(device)
        best = min(best, time.perf_counter() - started)
    return best


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


class _on_device:
    """run_baseline builds its tensors on the CPU; move them to the model's device for the duration."""

    def __init__(self, device: str, model: Any) -> None:
        self.device, self.model, self.original = device, model, None

    def __enter__(self) -> None:
        if self.device == "cpu":
            return
        self.original = self.model.generate
        original, device = self.original, self.device

        def generate(input_ids: Any, attention_mask: Any, **kwargs: Any) -> Any:
            return original(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), **kwargs)

        self.model.generate = generate

    def __exit__(self, *exc: object) -> None:
        if self.original is not None:
            self.model.generate = self.original


def _failures(output: str) -> str:
    return "\n".join(line for line in output.splitlines() if line.startswith(("FAILED", "ERROR")))[-1500:]


def print_table(rows: list[Row], device: str) -> None:
    print(f"\nSlipstream GPU check on {device}\n")
    width = max(len(row.check) for row in rows)
    print(f"{'check':<{width}}  {'status':<8} {'result':<70} baseline (same run)")
    print("-" * (width + 110))
    for row in rows:
        first, *rest = row.result.splitlines() or [""]
        print(f"{row.check:<{width}}  {row.status:<8} {first:<70} {row.baseline}")
        for line in rest[-20:]:
            print(f"{'':<{width}}  {'':<8} {line}")


def describe_device(cpu: bool) -> str:
    import torch

    if cpu or not torch.cuda.is_available():
        return f"CPU ({os.cpu_count()} cores), torch {torch.__version__}, {fused_kernels()}"
    properties = torch.cuda.get_device_properties(0)
    return (f"{properties.name} ({properties.total_memory / 2**30:.0f} GiB), {torch.cuda.device_count()} GPU(s), "
            f"torch {torch.__version__}, CUDA {torch.version.cuda}, {fused_kernels()}")


def fused_kernels() -> str:
    """Whether Megatron's fused kernels can be had: without them it falls back to local attention and torch
    optimizers (our SdpaAttention takes packed rows then), which megatron-core says in a warning per module."""
    found = []
    for module, name in (("transformer_engine", "Transformer Engine"), ("apex", "apex")):
        found.append(f"{name} {'present' if importlib.util.find_spec(module) else 'absent'}")
    return ", ".join(found)


def _write_json(path: Path, rows: list[Row], cpu: bool) -> None:
    path.write_text(json.dumps({"device": describe_device(cpu), "rows": [asdict(r) for r in rows]}, indent=2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="run every check on the CPU (what CI does)")
    parser.add_argument("--quick", action="store_true", help="small sizes: a minute or two")
    parser.add_argument("--wheels", type=Path, default=None, help="install these wheels first (offline machine)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("--train-shape", default=None, help="the train row on a benchmark model of "
                        "tools/bench/models.py (qwen2.5-0.5b: the real shape) instead of the check's own")
    parser.add_argument("--only", nargs="*", default=None, help="run only these checks: tests run megatron colocate "
                        "megatron-step engine train sync")
    parser.add_argument("--skip", nargs="*", default=[], help="list these checks as skipped without running them "
                        "(a CI run whose suite runs the same thing elsewhere); same names as --only")
    args = parser.parse_args(argv)
    if args.wheels is not None:
        install_wheels(args.wheels)
    from actors.runtime.logs import quiet_library_output

    quiet_library_output()  # the engine and train rows load models: no load bars between the rows' lines
    import torch

    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device here; use --cpu to run the checks on the CPU")
    device = "cpu" if args.cpu else "cuda"
    checks: dict[str, Callable[[], Row]] = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        workdir = Path(scratch)
        checks = {
            "tests": lambda: check_gpu_tests(args.cpu, args.quick),
            "run": lambda: check_run("torch", args.cpu, args.quick, workdir),
            "megatron": lambda: check_run("megatron", args.cpu, args.quick, workdir),
            "colocate": lambda: check_run("colocate", args.cpu, args.quick, workdir),
            "megatron-step": lambda: check_megatron_step(args.cpu, args.quick, workdir),
            "engine": lambda: check_engine_speed(device, args.quick),
            "train": lambda: check_train_step(device, args.quick, args.train_shape),
            "sync": lambda: check_weight_sync(device, args.quick),
        }
        if unknown := sorted(set(args.skip) - set(checks)):
            parser.error(f"--skip: no check named {', '.join(unknown)} (the checks: {' '.join(checks)})")
        rows = []
        for name, check in checks.items():
            if args.only is not None and name not in args.only:
                continue
            if name in args.skip:
                rows.append(Row(name, "skipped", "--skip"))
                continue
            print(f"gpu_check: {name} ...", file=sys.stderr, flush=True)
            started = time.monotonic()
            try:
                row = check()
            except Exception as error:
                row = Row(name, "FAILED", f"{error!r}\n{traceback.format_exc()[-1500:]}")
            row.seconds = row.seconds or time.monotonic() - started
            rows.append(row)
            # Each row as it lands: a run cut off by a deadline still leaves what it had learned.
            print(f"gpu_check: {name} {row.status} in {row.seconds:.0f} s: {row.result}", file=sys.stderr, flush=True)
            if args.json is not None:
                _write_json(args.json, rows, args.cpu)
    print_table(rows, describe_device(args.cpu))
    return 1 if any(row.status == "FAILED" for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
