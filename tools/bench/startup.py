"""Benchmark: start-up, launch to the end of the first trained step, against the floor any Python trainer pays.

    python -m tools.bench.startup                    # 5 interleaved repeats of floor, TRL, sync, fully-async
    python -m tools.bench.startup --repeats 3 --systems floor sync --json out.json

Issue #15 asks for the demo's first trained step within 4 s of launch. What a run must do before that step is
bounded below by work no design removes: start an interpreter, import torch and transformers, load the policy
and the reference model, generate one batch and train on it. The `floor` row does exactly that in one process
and nothing else (HF `generate`, one forward, backward and AdamW step on the batch): it is the start-up of the
leanest possible trainer on this machine, measured in the same run as the others.
The other rows are the learning benchmark's systems (`tools/bench/learning.py`: same warm start, data and
hyperparameters): TRL's `GRPOTrainer` (`pip install -e ".[bench]"`), and Slipstream synchronous and fully-async,
each actor in its own process.

Each repeat runs every system once, in a rotating order, so drift in the machine's load hits each alike; the
load average before each run is recorded. Per system: the median and range of the seconds from launch to the
end of the first step, and the floor's phases (imports, model loads, first generation, first step).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tools.bench.learning import Hyper, launch, prepare, slipstream_command, step_times, trl_command

REPO = Path(__file__).resolve().parents[2]
SYSTEMS = ("floor", "trl", "sync", "async")
STEPS = 2  # the first step is what is timed; a second lets every system end normally
TIMEOUT_S = 300.0
FLOOR_PHASES = ("imported", "loaded", "generated", "trained")


@dataclass
class StartupRecord:
    system: str
    repeat: int
    load_before: float  # 1-minute load average when the run was launched
    first_step_s: float  # launch to the end of the first step
    phases: dict[str, float]  # the floor's: launch to the end of each phase


# ------------------------------------------------------------------------------------------------ the floor
def floor_child(model: Path, train: Path, out: Path) -> None:
    """The leanest trainer's way to its first step, timestamped; runs in its own interpreter."""
    stamps: dict[str, float] = {}
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stamps["imported"] = time.time()
    hyper = Hyper()
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    optimizer = torch.optim.AdamW(policy.parameters(), lr=hyper.lr)
    stamps["loaded"] = time.time()
    lines = train.read_text(encoding="utf-8").splitlines()[: hyper.prompts_per_step]
    prompts = [json.loads(line)["input"] for line in lines for _ in range(hyper.samples_per_prompt)]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        sequences = policy.generate(**batch, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                    max_new_tokens=hyper.max_new_tokens, pad_token_id=tokenizer.pad_token_id)
    stamps["generated"] = time.time()
    attention = (sequences != tokenizer.pad_token_id).long()
    attention[:, : batch["attention_mask"].shape[1]] = batch["attention_mask"]
    completion = torch.zeros_like(sequences, dtype=torch.bool)
    completion[:, batch["input_ids"].shape[1]:] = True
    targets = sequences[:, 1:]
    log_probs = policy(sequences, attention_mask=attention).logits[:, :-1].log_softmax(-1)
    taken = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        reference_taken = reference(sequences, attention_mask=attention).logits[:, :-1].log_softmax(-1).gather(
            -1, targets.unsqueeze(-1)).squeeze(-1)
    mask = completion[:, 1:].float()
    advantages = torch.randn(sequences.shape[0], 1)  # the rewards' place: the step's cost does not depend on them
    kl = torch.exp(reference_taken - taken) - (reference_taken - taken) - 1
    loss = ((-advantages * taken + hyper.kl_coef * kl) * mask).sum() / mask.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    optimizer.step()
    stamps["trained"] = time.time()
    out.write_text(json.dumps(stamps))


# ---------------------------------------------------------------------------------------------- the runners
def run_one(system: str, repeat: int, warm: Path, data: dict[str, Path], workdir: Path) -> StartupRecord:
    run_dir = workdir / f"{system}-{repeat}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    hyper = Hyper(steps=STEPS)
    if system == "floor":
        command = [sys.executable, "-m", "tools.bench.startup", "--floor-child", str(warm), str(data["train"]),
                   str(run_dir / "floor.json")]
    elif system == "trl":
        command = trl_command(hyper, warm, data, run_dir, 0, 10**6)
    else:
        command = slipstream_command(system, hyper, warm, data, run_dir, 0, 10**6, ["--no-progress", "--no-plots"])
    load = os.getloadavg()[0]
    launched, _ = launch(command, run_dir / "console.log", TIMEOUT_S)
    if system == "floor":
        stamps = json.loads((run_dir / "floor.json").read_text())
        phases = {phase: stamps[phase] - launched for phase in FLOOR_PHASES}
        return StartupRecord(system, repeat, load, phases["trained"], phases)
    times = step_times(system, run_dir)
    if not times:
        raise SystemExit(f"bench_startup: {system} recorded no step ({run_dir})")
    return StartupRecord(system, repeat, load, times[min(times)] - launched, {})


# ------------------------------------------------------------------------------------------------ the table
def summarise(records: list[StartupRecord]) -> dict[str, dict[str, float]]:
    by_system: dict[str, list[StartupRecord]] = {}
    for record in records:
        by_system.setdefault(record.system, []).append(record)
    floor = [r.first_step_s for r in by_system.get("floor", [])]
    floor_median = statistics.median(floor) if floor else None
    summary = {}
    for system, runs in by_system.items():
        seconds = [r.first_step_s for r in runs]
        median = statistics.median(seconds)
        summary[system] = {"median_s": median, "min_s": min(seconds), "max_s": max(seconds),
                           "over_floor": median / floor_median if floor_median else float("nan")}
        if system == "floor":
            for phase in FLOOR_PHASES:
                summary[system][f"{phase}_s"] = statistics.median(r.phases[phase] for r in runs)
    return summary


def print_table(records: list[StartupRecord], summary: dict[str, dict[str, float]]) -> None:
    loads = [r.load_before for r in records]
    print(f"\nlaunch to the end of the first trained step, {len(records)} runs (load {min(loads):.1f}-"
          f"{max(loads):.1f}, {os.cpu_count()} cores)")
    header = f"{'system':<8} {'median s':>9} {'min s':>7} {'max s':>7} {'x floor':>8}"
    print(header)
    print("-" * len(header))
    for system in SYSTEMS:
        row = summary.get(system)
        if row is not None:
            print(f"{system:<8} {row['median_s']:>9.2f} {row['min_s']:>7.2f} {row['max_s']:>7.2f} "
                  f"{row['over_floor']:>8.2f}")
    floor = summary.get("floor")
    if floor is not None:
        phases = ", ".join(f"{phase} {floor[f'{phase}_s']:.2f}" for phase in FLOOR_PHASES)
        print(f"floor, seconds from launch (medians): {phases}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--workdir", type=Path, default=REPO / "runs" / "bench_startup")
    parser.add_argument("--json", type=Path, default=None, help="also write every run and the summary here")
    parser.add_argument("--floor-child", nargs=3, metavar=("MODEL", "TRAIN", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.floor_child:
        floor_child(*(Path(value) for value in args.floor_child))
        return
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    warm, data = prepare(args.workdir)
    records = []
    for repeat in range(args.repeats):
        order = args.systems[repeat % len(args.systems):] + args.systems[: repeat % len(args.systems)]
        for system in order:
            record = run_one(system, repeat, warm, data, args.workdir)
            records.append(record)
            print(f"[repeat {repeat + 1}/{args.repeats}] {system}: first step at {record.first_step_s:.2f} s "
                  f"(load {record.load_before:.1f})", flush=True)
    summary = summarise(records)
    print_table(records, summary)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"runs": [asdict(r) for r in records], "summary": summary}, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
