"""Pictures and a summary of a run directory, which the launcher of the head node writes at the end of every run
(and `python -m tools.plot_run RUN_DIR` writes again for any run directory).

RUN_DIR/plots/curves.png: the train reward (top) and the accuracies (bottom: train, the quantity the progress
line's `acc` shows, and each eval set's as markers), against learner steps and against wall-clock;
RUN_DIR/plots/staleness.png: the staleness of every trained sample. A run of several policies gets them per policy,
in each policy's directory (RUN_DIR/policies/<name>/plots), where its learner and evaluator wrote their metrics.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actors.config.policies import policy_of_run_dir, policy_run_dir
from actors.report.integrity import describe, write_certificate, write_policies_certificate
from actors.report.progress import REWARD_CORRECT, train_accuracy_key
from actors.report.run_clock import format_duration, run_seconds, run_starts
from actors.runtime.metrics import read_metrics

REWARD = "rollout/reward_mean"
PANELS = ("reward", "accuracy")  # the rows of curves.png
X_AXES = {"step": "learner step", "time": "wall-clock seconds"}  # its columns


@dataclass(frozen=True)
class Curve:
    """One line of curves.png: in which panel, against which x (a metrics field), named how."""

    panel: str
    x: str
    label: str
    style: str
    xs: list[float]
    ys: list[float]


def curves(train: list[dict[str, Any]], evals: list[dict[str, Any]]) -> list[Curve]:
    """The lines of curves.png: the train reward in its own panel (on its own scale: it is not always in [0, 1],
    and where it is 0 or 1 it would hide the accuracy line under it), the accuracies in the other, train accuracy
    being the quantity the progress line's `acc` shows, and each eval set's chosen the same way."""
    accuracy = train_accuracy_key(train)
    found = []
    for x in X_AXES:
        found.append(Curve("reward", x, "train reward (mean)", "-", *_series(train, REWARD, x)))
        found.append(Curve("accuracy", x, f"train: {_accuracy_name(accuracy)} (the progress line's acc)", "-",
                           *_series(train, accuracy, x)))
        for name in _eval_sets(evals):
            key = _eval_accuracy_key(evals, name)
            found.append(Curve("accuracy", x, f"eval {name}: {_accuracy_name(key)}", "o--", *_series(evals, key, x)))
    return [curve for curve in found if curve.xs]


def _series(records: list[dict[str, Any]], key: str, x: str) -> tuple[list[float], list[float]]:
    points = [(r[x], r[key]) for r in records if r.get(key) is not None and r.get(x) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def _eval_sets(evals: list[dict[str, Any]]) -> list[str]:
    return sorted({key[len("eval/"):-len("/accuracy")] for record in evals for key in record
                   if key.startswith("eval/") and key.endswith("/accuracy")})


def _eval_accuracy_key(evals: list[dict[str, Any]], name: str) -> str:
    """An eval set's accuracy as the train one is chosen (`train_accuracy_key`), so the lines compare."""
    correct = f"eval/{name}/{REWARD_CORRECT}"
    return correct if any(correct in record for record in evals) else f"eval/{name}/accuracy"


def _accuracy_name(key: str) -> str:
    return REWARD_CORRECT if key.endswith(REWARD_CORRECT) else "share of rewards >= 1"


def _finish_axis(axis: Any) -> None:
    """A legend for what the axis shows, or a word that it shows nothing (a run that failed before its first
    step): matplotlib warns on the console about a legend with nothing in it."""
    axis.grid(alpha=0.3)
    if axis.get_legend_handles_labels()[0]:
        axis.legend(fontsize=8)
    else:
        axis.text(0.5, 0.5, "nothing logged", transform=axis.transAxes, ha="center", va="center", color="gray")


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

    figure, axes = plt.subplots(len(PANELS), len(X_AXES), figsize=(12, 8), sharex="col")
    for curve in curves(train, evals):
        axes[PANELS.index(curve.panel)][list(X_AXES).index(curve.x)].plot(curve.xs, curve.ys, curve.style,
                                                                            label=curve.label)
    for row, panel in enumerate(PANELS):
        for column, label in enumerate(X_AXES.values()):
            axis = axes[row][column]
            axis.set_ylabel(panel)
            if panel == "accuracy":
                axis.set_ylim(-0.05, 1.05)
            if row == len(PANELS) - 1:
                axis.set_xlabel(label)
            _finish_axis(axis)
    figure.suptitle(f"{_title(run_dir)}: reward and accuracy")
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


def _title(run_dir: Path) -> str:
    policy = policy_of_run_dir(run_dir)
    return run_dir.name if policy is None else f"{run_dir.parent.parent.name}, policy {policy}"


def summarize(run_dir: Path) -> str:
    """The summary of a run's directory, or of a policy's (RUN_DIR/policies/<name>: timed by its run's clock)."""
    train = read_metrics(run_dir / "metrics" / "train.jsonl")
    evals = read_metrics(run_dir / "metrics" / "eval.jsonl")
    policy = policy_of_run_dir(run_dir)
    lines = [f"run: {run_dir}" if policy is None else f"policy {policy}: {run_dir}"]
    if train:
        last = train[-1]
        clock = run_dir if policy is None else run_dir.parent.parent
        lines.append(f"learner steps: {last.get('step')}  wall-clock: {wall_clock(clock)}  "
                     f"final train reward: {last.get('rollout/reward_mean', float('nan')):.3f}")
        counts = staleness_counts(train)
        if counts:
            total = sum(counts.values())
            lines.append("staleness: " + ", ".join(f"{k}: {100 * v / total:.0f}%" for k, v in sorted(counts.items())))
    # each eval set's accuracy, and its answers' median length (a reward can be won by dropping the reasoning)
    for key in sorted({k for r in evals for k in r if k.endswith(("/accuracy", "/response_length/median"))}):
        values = [(r["step"], r[key]) for r in evals if r.get(key) is not None]
        shown = ".0f" if key.endswith("median") else ".3f"
        if values:
            lines.append(f"{key}: {values[0][1]:{shown}} at version {values[0][0]} -> {values[-1][1]:{shown}} at "
                         f"version {values[-1][0]}")
    lines += gain_lines(evals)
    return "\n".join(lines)


def gain_lines(evals: list[dict]) -> list[str]:
    """Each eval set's last gain since its first round, paired by prompt, in standard errors: whether a held-out
    change is more than the noise of that many prompts (actors/evaluator/gains.py). The numbers that no prompt
    moved share one line: a "+0.000" line of its own each said nothing, and hid the gains among them."""
    lines, unmoved = [], {}
    for key in sorted({k for r in evals for k in r if "/gain/" in k}):
        last = next((r for r in reversed(evals) if r.get(key) is not None), None)
        if last is None:
            continue
        prefix, metric = key.split("/gain/", 1)
        error = last.get(f"{prefix}/gain_se/{metric}")
        since = f"version {last.get(f'{prefix}/gain_since')} -> {last['step']}"
        if last[key] == 0 and not error:
            unmoved.setdefault((prefix, since), []).append(metric)
            continue
        spread = f" ± {error:.3f} ({last[key] / error:+.1f} SE)" if error else ""
        lines.append(f"{prefix}/{metric} gain, {since} (paired over {last.get(f'{prefix}/gain_prompts')} prompts): "
                     f"{last[key]:+.3f}{spread}")
    lines += [f"{prefix}: {', '.join(metrics)} the same on every prompt, {since}"
              for (prefix, since), metrics in unmoved.items()]
    return lines


def wall_clock(run_dir: Path) -> str:
    """How long the run ran, on the run's clock: every start of it, not the time it sat stopped in between."""
    seconds = run_seconds(run_dir)
    if seconds is None:
        return "unknown"
    starts = run_starts(run_dir)
    return format_duration(seconds) + (f" over {starts} starts (stopped time not counted)" if starts > 1 else "")


def certify_run(run_dir: Path, *, prompts: Callable[[Path], dict[str, Any]] | None = None,
                run_failed: str | None = None, policies: Sequence[str] = ()) -> None:
    """RUN_DIR/integrity.json, and its verdicts on the console (`actors/report/integrity.py`); `prompts` reads the
    buffer's account of its prompts (`actors.buffer.accounting.prompt_verdict`) from a run's or a policy's directory;
    `run_failed`: why the run failed, where it did; `policies`: the run's, for a certificate per policy."""
    try:
        if policies:
            accounts = {name: prompts(policy_run_dir(run_dir, name)) if prompts is not None else None
                        for name in policies}
            certificate = write_policies_certificate(run_dir, accounts, run_failed=run_failed)
        else:
            certificate = write_certificate(run_dir, prompts=prompts(run_dir) if prompts is not None else None,
                                            run_failed=run_failed)
    except Exception as error:
        print(f"launcher.py: could not write the integrity certificate: {error!r}", file=sys.stderr)
        return
    print("\n".join(describe(certificate)), file=sys.stderr)


def report_run(run_dir: Path, policies: Sequence[str] = ()) -> None:
    """Plots and a summary at the end of a launcher's run, per policy for a run of several (`policies`); a failure
    here never changes the run's exit code."""
    for name, directory in [(f"policy {name}", policy_run_dir(run_dir, name)) for name in policies] or [
            ("the run", run_dir)]:
        try:
            plots = plot_run(directory)
            print(summarize(directory), file=sys.stderr)
            print("plots: " + ", ".join(str(p) for p in plots), file=sys.stderr)
        except Exception as error:
            print(f"launcher.py: could not plot {name}: {error!r}", file=sys.stderr)
