"""slime's ``--eval-function-path``: an eval round made by one call of the user's ``generate_rollout(args, rollout_id,
data_source, evaluation=True)``.

slime calls it once per eval round; it generates every dataset itself against the server in ``args`` and returns
``RolloutFnEvalOutput(data={dataset: {"rewards": [...], "truncated": [...], "samples": [...]}}, metrics)`` (or the
``data`` dict alone). Here the evaluator's round is one group marked ``WHOLE_ROUND``; the rollout worker that leases
it (pinned at the evaluated version, like any group of a round) calls this instead of generating, with ``args``
pointing at its own engine and ``rollout_id`` the evaluated version. Each reward becomes one scored sample naming its
dataset (its prompt, response and label from the function's sample when there is one; no tokens: nothing trains
on it), so the round travels back to the evaluator the way every eval group does. The function gets no training
groups: its ``data_source`` refuses them.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import numpy as np

from actors.config import RunConfig
from actors.config.engines import http_engine_problem
from actors.extensions.points import ROUND_DATASET, ROUND_METRICS, WHOLE_ROUND
from actors.slime_compat.args import build_args
from actors.slime_compat.plugins import accepted_kwargs
from actors.slime_compat.rollout_function import FunctionThread
from bus.schema import PromptGroup
from bus.schema import Sample as WireSample
from policies.plugins import load_callable

__all__ = ["FLAG", "EvalFunctionRound", "check_eval_function", "round_samples"]

FLAG = "--eval-function-path"


class NoTrainingGroups:
    """The ``data_source`` an eval function gets: an eval round reads its own datasets."""

    def get_samples(self, num_samples: int) -> list[Any]:
        raise RuntimeError(f"{FLAG}: an eval round gets no training groups from data_source; read the eval "
                           "datasets (args.eval_prompt_data) in the function")

    add_samples = get_samples

    def __len__(self) -> int:
        return 0


def check_eval_function(config: RunConfig) -> None:
    """Refuse at a rollout worker's start what cannot run an eval function (before its engine loads)."""
    path = config.eval.eval_function_path
    if path:
        problem = http_engine_problem(config.engine.rollout_engine, f"{FLAG} {path}: a slime eval function")
        if problem is not None:
            raise ValueError(problem)


class EvalFunctionRound:
    """A generate function (context, group) -> samples for the round groups: one call of the user's function."""

    def __init__(self, config: RunConfig, server_url: str) -> None:
        self.path = config.eval.eval_function_path or ""
        self.fn = load_callable(self.path, what=FLAG)
        self.args = build_args(config, server_url=server_url)
        self.kwargs = accepted_kwargs(self.fn, {"evaluation": True})
        self.thread = FunctionThread(name=f"eval-function:{self.path}")

    async def __call__(self, context: Any, group: PromptGroup) -> list[WireSample]:
        version = int(group.metadata[WHOLE_ROUND])
        future = self.thread.submit(lambda: self.fn(self.args, version, NoTrainingGroups(), **self.kwargs))
        return round_samples(await asyncio.wrap_future(future), group, path=self.path)


def round_samples(output: Any, group: PromptGroup, *, path: str) -> list[WireSample]:
    """The function's results as scored samples of `group`, or an error naming the function and the dataset."""
    data = output.data if hasattr(output, "data") else output
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{FLAG} {path} returned {type(output).__name__}; expected RolloutFnEvalOutput or a dict "
                         "{dataset: {'rewards': [...]}} of at least one dataset")
    metrics = getattr(output, "metrics", None) or {}
    numeric = {str(k): float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    samples: list[WireSample] = []
    for name, result in data.items():
        rewards = result.get("rewards") if isinstance(result, dict) else None
        if not isinstance(rewards, list) or not rewards or not all(_number(r) for r in rewards):
            raise ValueError(f"{FLAG} {path}: dataset {name!r}: 'rewards' must be a non-empty list of finite "
                             "numbers (one per sample; slime's eval_reward_key picks a dict reward's)")
        truncated = result.get("truncated") or [False] * len(rewards)
        given = result.get("samples") or []
        if len(truncated) != len(rewards) or (given and len(given) != len(rewards)):
            raise ValueError(f"{FLAG} {path}: dataset {name!r}: {len(rewards)} rewards, {len(truncated)} truncated "
                             f"flags and {len(given)} samples; they go one per sample")
        for index, reward in enumerate(rewards):
            own = given[index] if given else None
            metadata: dict[str, Any] = {ROUND_DATASET: str(name)}
            if not samples and numeric:
                metadata[ROUND_METRICS] = numeric
            samples.append(WireSample(
                sample_id=f"{group.group_id}/{len(samples)}", group_id=group.group_id, index=len(samples),
                prompt=_text(getattr(own, "prompt", "")), response=str(getattr(own, "response", "") or ""),
                label=_plain(getattr(own, "label", None)), reward=float(reward),
                tokens=np.zeros(0, dtype=np.int32), token_versions=np.zeros(0, dtype=np.int32),
                status="truncated" if truncated[index] else "completed", metadata=metadata))
    return samples


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _text(prompt: Any) -> str | list[dict[str, Any]]:
    return prompt if isinstance(prompt, str) or (isinstance(prompt, list) and all(
        isinstance(m, dict) for m in prompt)) else str(prompt)


def _plain(label: Any) -> Any:
    """A label as the wire carries it: JSON-like values as they are, anything else as its text."""
    return label if label is None or isinstance(label, (str, int, float, bool)) else str(label)
