"""slime's ``async_rm`` and ``batched_async_rm`` (``slime.rollout.rm_hub``): a plugin scores its own samples; and
``compute_score`` (``slime.rollout.rm_hub.math_dapo_utils``), DAPO's math scorer, which slime's retool example calls.

slime's multi-agent example scores each agent's answer inside its generate call. The reward is chosen as slime
chooses it: the sample's own ``custom_rm_path``, then ``--custom-rm-path``, then the rm type (the sample's
``metadata["rm_type"]``, then ``--rm-type``, a ``boxed_`` prefix scoring the last boxed answer). The rm types are
our reward registry's (`policies.rewards`, ``boxed_`` included); a slime-style ``rm(args, sample)`` is called as
slime calls it (in the batched form with the whole list, as slime does), one of ours through our reward runner. A
reward that fails raises, naming the reward and why: the plugin's response fails with it, as a slime reward error
would.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from typing import Any

from actors.slime_compat.plugins import accepted_kwargs, is_slime_style
from actors.slime_compat.sample import Sample
from bus.schema import FINISH_BY_STATUS
from policies.plugins import load_callable
from policies.rewards import RewardInput, RewardSpec, build_reward, prompt_text, score, score_group
from policies.rewards.dapo import dapo_verdict

__all__ = ["async_rm", "batched_async_rm", "compute_score"]


async def async_rm(args: Any, sample: Sample, **kwargs: Any) -> Any:
    """One sample's reward."""
    path = sample.custom_rm_path or getattr(args, "custom_rm_path", None)
    if path:
        function = load_callable(path, what="async_rm: custom_rm_path")
        if is_slime_style(function, 2):
            return await _maybe_await(function(args, sample, **accepted_kwargs(function, kwargs)))
        return (await _score(args, _spec(None, path, False, None), [sample]))[0]
    rm_type = str((sample.metadata or {}).get("rm_type") or getattr(args, "rm_type", None) or "").strip()
    if not rm_type:
        raise ValueError("async_rm: no reward chosen: the sample has no custom_rm_path or metadata['rm_type'], "
                         "and args has neither custom_rm_path nor rm_type (--custom-rm-path, --rm-type)")
    spec = _spec(rm_type, None, False, getattr(args, "rm_url", None))
    return (await _score(args, spec, [sample]))[0]


async def batched_async_rm(args: Any, samples: list[Sample], **kwargs: Any) -> list[Any]:
    """Each sample's reward, in order: with ``--custom-rm-path`` one call on the whole list (slime's batch mode),
    else each sample's own reward, concurrently."""
    path = getattr(args, "custom_rm_path", None)
    if not path:
        return list(await asyncio.gather(*(async_rm(args, sample, **kwargs) for sample in samples)))
    function = load_callable(path, what="batched_async_rm: custom_rm_path")
    if is_slime_style(function, 2):
        return list(await _maybe_await(function(args, samples, **accepted_kwargs(function, kwargs))))
    return await _score(args, _spec(None, path, bool(getattr(args, "group_rm", False)), None), samples)


@functools.lru_cache(maxsize=16)
def _spec(rm_type: str | None, path: str | None, group: bool, rm_url: str | None) -> RewardSpec:
    return build_reward(rm_type, custom_rm_path=path, group_rm=group, rm_url=rm_url)


def compute_score(solution_str: str, ground_truth: Any, strict_box_verify: bool = False,
                  pause_tokens_index: list[int] | None = None) -> dict[str, Any]:
    """slime's DAPO scorer under its own name and parameters: ``{"score": 1.0 or -1.0, "acc", "pred"}``
    (`policies.rewards.dapo` says how each mode judges)."""
    return dapo_verdict(solution_str, ground_truth, strict_box=strict_box_verify, pause_positions=pause_tokens_index)


async def _score(args: Any, spec: RewardSpec, samples: list[Sample]) -> list[float]:
    inputs = [_reward_input(sample) for sample in samples]
    timeout = getattr(args, "reward_timeout", None)
    key = getattr(args, "reward_key", None)
    outcomes = await (score_group(spec.fn, inputs, timeout_s=timeout, key=key) if spec.is_group
                      else score(spec.fn, inputs, timeout_s=timeout, key=key))
    failed = [(sample.index, outcome.reason)
              for sample, outcome in zip(samples, outcomes, strict=True) if outcome.status != "ok"]
    if failed:
        raise RuntimeError(f"reward {spec.name!r} failed for sample(s) " + "; ".join(
            f"{index}: {reason}" for index, reason in failed))
    return [float(outcome.reward) for outcome in outcomes]  # type: ignore[arg-type]


def _reward_input(sample: Sample) -> RewardInput:
    """What a reward of ours reads, from a slime sample (tokens are prompt + response, as slime keeps them)."""
    n = int(sample.response_length)
    tokens = list(sample.tokens)
    status = sample.status.value if isinstance(sample.status, Sample.Status) else str(sample.status)
    return RewardInput(prompt=prompt_text(sample.prompt), response=sample.response, label=sample.label,
                       metadata=dict(sample.metadata or {}), prompt_ids=tokens[:len(tokens) - n],
                       response_ids=tokens[len(tokens) - n:],
                       finish_reason=FINISH_BY_STATUS.get(status))  # type: ignore[arg-type]


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value
