"""Pictures and a summary of a run directory, which the launcher of the head node writes at the end of every run
(and `python tools/plot_run.py RUN_DIR` writes again for any run directory).

RUN_DIR/plots/curves.png: reward and accuracy against learner steps and against wall-clock, eval accuracy as
markers; RUN_DIR/plots/staleness.png: the staleness of every trained sample.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from actors.runtime.integrity import describe, write_certificate
from actors.runtime.metrics import read_metrics


def _series(records: list[dict[str, Any]], key: str, x: str) -> tuple[list[float], list[float]]:
    points = [(r[x], r[key]) for r in records if r.get(key) is not None and r.get(x) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def staleness_counts(records: list[dict[str, Any]]) -> Counter[int]:
    counts: Counter[int] = Counter()
    for record in records:
        for key, value in record.items():
            if key.startswith("staleness/hist_") and value:
                counts[int(key.rsplit("_", 1)[1])] += int(value)
    return counts


def plot_run(run_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = read_metrics(run_dir / "metrics" / "train.jsonl")
    evals = read_metrics(run_dir / "metrics" / "eval.jsonl")
    out = run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []

    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for axis, x, label in ((axes[0], "step", "learner step"), (axes[1], "time", "wall-clock seconds")):
        for key, name in (("rollout/reward_mean", "train reward"), ("rollout/accuracy", "train accuracy")):
            xs, ys = _series(train, key, x)
            if xs:
                axis.plot(xs, ys, label=name)
        for key in sorted({k for r in evals for k in r if k.endswith("/accuracy")}):
            xs, ys = _series(evals, key, x)
            if xs:
                axis.plot(xs, ys, "o--", label=key)
        axis.set_xlabel(label)
        axis.set_ylim(-0.05, 1.05)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle(f"{run_dir.name}: reward and accuracy")
    figure.tight_layout()
    figure.savefig(out / "curves.png", dpi=110)
    plt.close(figure)
    written.append(out / "curves.png")

    counts = staleness_counts(train)
    figure, axis = plt.subplots(figsize=(6, 4))
    if counts:
        keys = sorted(counts)
        axis.bar(keys, [counts[k] for k in keys])
        axis.set_xticks(keys)
    axis.set_xlabel("staleness at consumption (learner version - oldest token version)")
    axis.set_ylabel("trained samples")
    axis.set_title("staleness of trained samples")
    figure.tight_layout()
    figure.savefig(out / "staleness.png", dpi=110)
    plt.close(figure)
    written.append(out / "staleness.png")
    return written


def summarize(run_dir: Path) -> str:
    train = read_metrics(run_dir / "metrics" / "train.jsonl")
    evals = read_metrics(run_dir / "metrics" / "eval.jsonl")
    lines = [f"run: {run_dir}"]
    if train:
        last = train[-1]
        lines.append(f"learner steps: {last.get('step')}  wall-clock: {last.get('time', 0):.0f}s  "
                     f"final train reward: {last.get('rollout/reward_mean', float('nan')):.3f}")
        counts = staleness_counts(train)
        if counts:
            total = sum(counts.values())
            lines.append("staleness: " + ", ".join(f"{k}: {100 * v / total:.0f}%" for k, v in sorted(counts.items())))
    for key in sorted({k for r in evals for k in r if k.endswith("/accuracy")}):
        values = [(r["step"], r[key]) for r in evals if r.get(key) is not None]
        if values:
            lines.append(f"{key}: {values[0][1]:.3f} at version {values[0][0]} -> {values[-1][1]:.3f} at version "
                         f"{values[-1][0]}")
    return "\n".join(lines)


def certify_run(run_dir: Path, *, prompts: Callable[[Path], dict[str, Any]] | None = None) -> None:
    """RUN_DIR/integrity.json, and its verdicts on the console (`actors/runtime/integrity.py`); `prompts` reads the
    buffer's account of its prompts (`actors.buffer.accounting.prompt_verdict`)."""
    try:
        certificate = write_certificate(run_dir, prompts=prompts(run_dir) if prompts is not None else None)
    except Exception as error:
        print(f"launcher.py: could not write the integrity certificate: {error!r}", file=sys.stderr)
        return
    print("\n".join(describe(certificate)), file=sys.stderr)


def report_run(run_dir: Path) -> None:
    """Plots and a summary at the end of a launcher's run; a failure here never changes the run's exit code."""
    try:
        plots = plot_run(run_dir)
        print(summarize(run_dir), file=sys.stderr)
        print("plots: " + ", ".join(str(p) for p in plots), file=sys.stderr)
    except Exception as error:
        print(f"launcher.py: could not plot the run: {error!r}", file=sys.stderr)
