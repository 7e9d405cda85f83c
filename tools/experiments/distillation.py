"""On-policy distillation on a real model: does a student close the held-out gap to its teacher?

    python -m tools.experiments.distillation [--workdir runs/distill] [--teacher DIR] [--second-teacher DIR]

The student is SmolLM2-135M-Instruct as it comes (about one held-out sum in ten right). The teachers are the same
model after the demo's fully-async GRPO run, one per task: sums of a two-digit and a one-digit number (`sums`), and
sums of two two-digit numbers (`two-digit`); `--teacher`/`--second-teacher` reuse folders from earlier runs. The
student then trains by distillation alone (`--use-opd --rm-type zero`: the teacher's log-probs of the student's
own tokens are the only signal), with the demo's settings otherwise (LoRA rank 16, 16 steps, fully async):

- `learner`: the sums teacher held by the learner (`--opd-teacher-load`);
- `server`: the sums teacher as a server of its own (our SGLang-compatible server over the torch engine), asked
  by the reward worker (`--opd-teacher teacher=URL`);
- `two teachers`: both tasks' prompts mixed, each prompt's `teacher` field naming its teacher, the sums teacher
  held by the learner and the two-digit teacher a server (`--opd-teacher-key teacher`).

Every model is scored the same way afterwards: greedy, on each task's 100 held-out pairs, with the reward the demo
trains on (`final_number`: the right number in an answer the model ended). Prints a table (the gap closed is
(student after - student before) / (teacher - student before)) and writes it to WORKDIR/results.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from actors.runtime.logs import quiet_library_output
from engines.sglang.launch import ServerProcess, ServerSpec
from tools.demo import REPO, SMOLLM2_EVAL_PROMPTS, SMOLLM2_GRPO, override_flags, run_launcher
from tools.evaluate import evaluate_model
from tools.make_arithmetic_data import make_sum_questions, make_two_digit_sum_questions, write_jsonl

TASKS = {"sums": make_sum_questions, "two-digit": make_two_digit_sum_questions}
LORA = ["--lora-rank", "16", "--lora-alpha", "32"]
# The student's run: the demo's, with no task reward and no eval rounds (their reward would be the zero one).
DISTILL = override_flags(SMOLLM2_GRPO, {"--rm-type": "zero", "--eval-interval": None, "--use-opd": ""})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=REPO / "runs" / "distill")
    parser.add_argument("--teacher", type=Path, default=None, help="the sums teacher (default: train it)")
    parser.add_argument("--second-teacher", type=Path, default=None, help="the two-digit teacher (default: train it)")
    parser.add_argument("--modes", nargs="*", default=["learner", "server", "two teachers"],
                        choices=["learner", "server", "two teachers"])
    args = parser.parse_args()
    quiet_library_output()
    from engines.pretrained import SMOLLM2, cached_pretrained

    started = time.monotonic()
    student = cached_pretrained(SMOLLM2, REPO / ".cache")
    data = {task: make(args.workdir / f"data-{task}", eval_size=SMOLLM2_EVAL_PROMPTS) for task, make in TASKS.items()}
    teachers: dict[str, Path | None] = {"sums": args.teacher, "two-digit": args.second_teacher}
    if teachers["sums"] is None:
        teachers["sums"] = train_teacher(student, data["sums"], args.workdir / "teacher-sums")
    if teachers["two-digit"] is None and "two teachers" in args.modes:
        teachers["two-digit"] = train_teacher(student, data["two-digit"], args.workdir / "teacher-two-digit")
    scores = {"student before": held_out(student, data)}
    for task, teacher in teachers.items():
        if teacher is not None:
            scores[f"teacher ({task})"] = held_out(teacher, data)
    for mode in args.modes:
        run_dir = args.workdir / f"{time.strftime('%Y%m%d-%H%M%S')}-{mode.replace(' ', '-')}"
        seconds = distill(mode, student, teachers, data, run_dir)
        scores[f"student after: {mode}"] = {**held_out(run_dir / "final_model", data), "seconds": seconds}
    report(scores, args.workdir / "results.json", time.monotonic() - started)


def train_teacher(student: Path, task_data: dict[str, Path], run_dir: Path) -> Path:
    """The demo's GRPO run on one task; its merged final model is the teacher."""
    run_launcher(["--head", "--run-dir", str(run_dir), "--hf-checkpoint", str(student), "--prompt-data",
                  str(task_data["train"]), *override_flags(SMOLLM2_GRPO, {"--eval-interval": None}), *LORA])
    return run_dir / "final_model"


def distill(mode: str, student: Path, teachers: dict[str, Path | None], data: dict[str, dict[str, Path]],
            run_dir: Path) -> float:
    """One distillation run of the student; returns its seconds from launch to exit."""
    server = None
    prompts = data["sums"]["train"]
    if mode == "learner":
        teacher_flags = ["--opd-teacher-load", str(teachers["sums"])]
    else:
        served = teachers["sums"] if mode == "server" else teachers["two-digit"]
        assert served is not None
        server = ServerProcess(ServerSpec(model_path=str(served), module="tools.standins.sglang_server",
                                          random_seed=0, extra={"torch-threads": "1"}),
                               startup_timeout=300, log_dir=run_dir.parent / f"{run_dir.name}-teacher-logs")
        server.start()
        if mode == "server":
            teacher_flags = ["--opd-teacher", f"teacher={server.url}"]
        else:
            teacher_flags = ["--opd-teacher", f"sums={teachers['sums']}", f"two-digit={server.url}",
                             "--opd-teacher-key", "teacher"]
            prompts = mixed_prompts(data, run_dir.parent / "data-mixed.jsonl")
    started = time.monotonic()
    try:
        run_launcher(["--head", "--run-dir", str(run_dir), "--hf-checkpoint", str(student), "--prompt-data",
                      str(prompts), *DISTILL, *LORA, *teacher_flags])
    finally:
        if server is not None:
            server.stop()
    return time.monotonic() - started


def mixed_prompts(data: dict[str, dict[str, Path]], out: Path) -> Path:
    """Both tasks' training prompts, alternating, each naming its teacher in its `teacher` metadata field."""
    tasks = {task: [json.loads(line) for line in paths["train"].read_text().splitlines()]
             for task, paths in data.items()}
    count = min(len(records) for records in tasks.values())
    write_jsonl(out, [{**tasks[task][index], "metadata": {"teacher": task}}
                      for index in range(count) for task in tasks])
    return out


def held_out(model: Path, data: dict[str, dict[str, Path]]) -> dict[str, float]:
    """Greedy accuracy of `model` on each task's held-out pairs, as the demo's eval rounds score them."""
    return {task: asyncio.run(evaluate_model(model, paths["eval"], reward="final_number", max_new_tokens=12,
                                             apply_chat_template=True))["accuracy"]
            for task, paths in data.items()}


def report(scores: dict[str, dict[str, float]], out: Path, seconds: float) -> None:
    before = scores["student before"]
    print("\n" + "=" * 88)
    print(f"held-out accuracy (greedy, {SMOLLM2_EVAL_PROMPTS} pairs per task never trained on), "
          "SmolLM2-135M-Instruct, distillation only (no task reward)")
    print(f"  {'model':<34}{'sums':>8}{'two-digit':>11}   gap closed (sums / two-digit)   run")
    for name, row in scores.items():
        closed = []
        for task in TASKS:
            teacher = scores.get(f"teacher ({task})", {}).get(task)
            if name.startswith("student after") and teacher is not None and teacher > before[task]:
                closed.append(f"{(row[task] - before[task]) / (teacher - before[task]):.0%}")
            else:
                closed.append("")
        run = f"{row['seconds']:.0f}s" if "seconds" in row else ""
        print(f"  {name:<34}{row['sums']:>8.0%}{row['two-digit']:>11.0%}   {' / '.join(closed):<31}{run}")
    print(f"  total {seconds:.0f}s; results: {out}")
    print("=" * 88)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(scores, indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()
