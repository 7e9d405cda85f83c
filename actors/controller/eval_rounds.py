"""Evaluation rounds run by the rollout workers between training work, scored like any group.

Every `--eval-interval` learner versions, once before training and once for the final version (the run waits
for that one, up to `--final-eval-timeout`), the buffer queues each eval set's prompts ahead of training
prompts; eval groups bypass admission and never enter the training pool. When a round's last group returns,
the round's mean reward and pass@k are written to `metrics/eval.jsonl`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from actors.buffer.core import BufferCore
from actors.buffer.prompt_data import PromptRecord, load_prompts
from actors.config import RunConfig
from actors.rollout.prompt_tokens import prompt_length_counter
from actors.runtime.metrics import MetricsWriter
from bus.schema import PromptGroup, ScoredGroup


@dataclass
class EvalRound:
    version: int
    name: str
    expected: int
    rewards: dict[str, list[float]] = field(default_factory=dict)
    failed: int = 0


def pass_at_k(rewards_per_prompt: list[list[float]], threshold: float = 1.0) -> float:
    """Fraction of prompts with at least one sample at or above the success threshold."""
    if not rewards_per_prompt:
        return float("nan")
    return float(np.mean([any(r >= threshold for r in rewards) for rewards in rewards_per_prompt]))


class EvalRounds:
    def __init__(self, config: RunConfig, core: BufferCore, writer: MetricsWriter, log: Any,
                 tokenizer: Any | None = None) -> None:
        self.config = config
        self.core = core
        self.writer = writer
        self.log = log
        self.sets: dict[str, list[PromptRecord]] = {}
        self.skipped_long: dict[str, int] = {}  # eval prompts over --eval-max-prompt-len, per set
        max_prompt = config.eval.eval_max_prompt_len
        count_tokens = prompt_length_counter(config, tokenizer) if max_prompt and config.eval.sets else None
        for name, path in config.eval.sets.items():
            records, report = load_prompts(path, input_key=config.eval.eval_input_key or config.data.input_key,
                                           label_key=config.eval.eval_label_key or config.data.label_key,
                                           metadata_key=config.data.metadata_key, skip_bad=config.data.skip_bad_data,
                                           max_prompt_len=max_prompt, count_tokens=count_tokens)
            self.sets[name] = records
            for problem in report.skipped:
                log.warning("skipped eval record", problem=problem)
            if report.too_long:
                self.skipped_long[name] = report.too_long
                log.warning("skipped long eval prompts", set=name, count=report.too_long,
                            max_prompt_tokens=max_prompt, kept=report.records)
        self.rounds: dict[tuple[int, str], EvalRound] = {}
        self.started_versions: set[int] = set()

    def maybe_start(self, version: int, *, final: bool = False) -> None:
        """Queue a round at every interval-th version, and for the final version whatever the interval."""
        interval = self.config.eval.eval_interval
        due = final or bool(interval and version % interval == 0)
        if version == 0 and not final and self.config.eval.skip_eval_before_train:
            due = False
        if not self.sets or not due or version in self.started_versions:
            return
        self.started_versions.add(version)
        for name, records in self.sets.items():
            self.rounds[(version, name)] = EvalRound(version=version, name=name, expected=len(records))
            for record in records:
                self.core.eval_queue.append(PromptGroup(
                    group_id=f"eval:{name}:{version}:{record.data_index}", prompt=record.prompt, label=record.label,
                    metadata=record.metadata, n_samples=self.config.eval.n_samples_per_eval_prompt,
                    data_index=record.data_index, is_eval=True,
                ))

    @property
    def pending(self) -> bool:
        """A round is queued or generating: the run should not end before it reports."""
        return bool(self.rounds)

    def record(self, group: ScoredGroup) -> None:
        _, name, version, _ = group.group_id.split(":", 3)
        current = self.rounds.get((int(version), name))
        if current is None:
            return
        rewards = [s.reward for s in group.samples if s.reward is not None]
        current.failed += len(group.samples) - len(rewards)
        current.rewards[group.group_id] = [float(r) for r in rewards]
        if len(current.rewards) == current.expected:
            self._finish(current)

    def _finish(self, current: EvalRound) -> None:
        del self.rounds[(current.version, current.name)]
        per_prompt = list(current.rewards.values())
        flat = [r for rewards in per_prompt for r in rewards]
        k = self.config.eval.n_samples_per_eval_prompt
        metrics = {
            f"eval/{current.name}/mean_reward": float(np.mean(flat)) if flat else float("nan"),
            f"eval/{current.name}/accuracy": float(np.mean([r >= 1.0 for r in flat])) if flat else float("nan"),
            f"eval/{current.name}/pass@{k}": pass_at_k(per_prompt),
            f"eval/{current.name}/failed_samples": current.failed,
        }
        self.writer.write(current.version, metrics)
        self.log.info("eval round done", version=current.version, set=current.name,
                      **{key.rsplit("/", 1)[1]: round(value, 4) for key, value in metrics.items()})
