"""The rows of `tools/gpu_check.py` that run something whole in its own process: a short run through the launcher
per training backend (and a colocated LoRA run), and the Megatron step benchmark."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

from tools.gpu_check_row import REPO, Row

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
    from engines.tiny_model import TinyModelSpec, cached_tiny_model
    from tools.make_arithmetic_data import make_arithmetic_data

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
    name = "megatron step: packed (thd) vs padded rows"
    if missing := _megatron_missing():
        return Row(name, "skipped", missing)
    out = workdir / "megatron-step.json"
    command = [sys.executable, "tools/bench_megatron_packing.py", "--json", str(out),
               *(["--quick"] if quick else ["--repeats", "3"])]
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if cpu else {})}
    completed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, env=env, check=False)
    if completed.returncode != 0 or not out.exists():
        return Row(name, "FAILED", f"exit {completed.returncode}\n{completed.stderr[-1500:]}")
    rows = {row["layout"]: row for row in json.loads(out.read_text(encoding="utf-8"))["rows"]}
    packed, padded = rows["thd"], rows["bshd"]
    return Row(name, "ok", f"{packed['seconds'] * 1000:.1f} ms ({packed['speedup']:.2f}x the padded rows' tokens/s)"
               f", {padded['padded_fraction']:.0%} of padded slots were padding",
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
