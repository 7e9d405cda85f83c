"""Held-out gains paired by prompt: each eval round's score per prompt, and what changed since the set's first round.

An eval set scored before and after training is a paired design: the same prompts both times, so each prompt's
difficulty cancels out of its own difference. The standard error of the mean difference is what a before/after
claim rests on; the unpaired one (the two rounds' errors added) counts the prompts' spread in difficulty twice, and
a gain of 4% -> 13% on 100 prompts is 2.3 unpaired standard errors but 3.1 paired ones when no prompt was lost.

Every round's per-prompt scores go to `metrics/eval_scores.jsonl`, one row per round and set: for an analysis of
which prompts moved, and for a restarted evaluator, which finds its baselines there.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from policies.rewards import extras_means

PromptScores = dict[str, dict[str, float]]  # a prompt's data index (as text) -> metric -> its mean over its samples
SCORES_FILE = "eval_scores"  # metrics/eval_scores.jsonl


def prompt_scores(rewards: list[float], extras: list[Mapping[str, Any]]) -> dict[str, float]:
    """One prompt's scores: its samples' mean reward, and the mean of each number its reward reported beside it
    (`reward/correct`, named as in eval.jsonl)."""
    scores = {"mean_reward": float(np.mean(rewards))} if rewards else {}
    scores.update({f"reward/{name}": value for name, value in extras_means(extras).items()})
    return scores


def paired_gains(set_name: str, baseline: PromptScores, current: PromptScores) -> dict[str, float]:
    """For every metric both rounds scored: `eval/SET/gain/METRIC`, the mean over the prompts both scored of
    (now - baseline), and with two or more prompts `eval/SET/gain_se/METRIC`, its standard error (the differences'
    sample deviation over the square root of their count); `eval/SET/gain_prompts`: how many prompts pair up."""
    shared = sorted(baseline.keys() & current.keys())  # a fixed order: the same sums in every process
    metrics: dict[str, float] = {}
    for metric in sorted({name for key in shared for name in current[key]}):
        differences = np.array([current[key][metric] - baseline[key][metric] for key in shared
                                if metric in current[key] and metric in baseline[key]])
        if not differences.size:
            continue
        metrics[f"eval/{set_name}/gain/{metric}"] = float(differences.mean())
        if differences.size >= 2:
            metrics[f"eval/{set_name}/gain_se/{metric}"] = float(differences.std(ddof=1) / math.sqrt(differences.size))
    metrics[f"eval/{set_name}/gain_prompts"] = len(shared)
    return metrics


def first_rounds(path: Path) -> dict[str, tuple[int, PromptScores]]:
    """Each set's first round in `path` (eval_scores.jsonl): the baselines a restarted evaluator pairs against. A
    line torn by a kill is skipped."""
    baselines: dict[str, tuple[int, PromptScores]] = {}
    if not path.exists():
        return baselines
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("scores"), dict):
            baselines.setdefault(str(record.get("set")), (int(record["step"]), record["scores"]))
    return baselines
