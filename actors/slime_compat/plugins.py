"""Load slime-style plugins next to ours: detection by signature, and adapters onto our seams.

slime's plugins take ``args`` first: ``async generate(args, sample, sampling_params) -> Sample``,
``async rm(args, sample, **kw) -> float`` (``rm(args, samples, **kw) -> list[float]`` under ``--group-rm``),
filters ``(args, samples, **kw) -> DynamicFilterOutput | bool`` and rollout sample hooks
``hook(args, sample, *, rollout_id=None, evaluation=False) -> Sample | None``. Ours take one typed context object
(generate: ``(context, group)``; reward: ``(RewardInput)``; filter: ``(FilterGroup)``). A function is slime-style
when its first parameter is named ``args`` and it takes slime's count of positional parameters; anything else
loads as ours, unchanged. A user's plugin keeps its ``slime.*`` imports (`actors.slime_compat.imports`).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from actors.config import RunConfig
from actors.config.engines import http_engine_problem
from actors.extensions.points import BatchRewrite
from actors.slime_compat.args import build_args, sampling_params
from actors.slime_compat.sample import Sample, from_group, from_wire, to_wire, to_wire_episode
from bus.schema import PromptGroup
from bus.schema import Sample as WireSample
from policies.filters import FilterGroup, FilterVerdict
from policies.plugins import load_callable, load_object

__all__ = ["DynamicFilterOutput", "adapt_filter", "adapt_generate", "adapt_reward", "is_slime_style",
           "load_reward_post_process",
           "load_slime_reward"]


@dataclass
class DynamicFilterOutput:
    """What a slime dynamic-sampling filter returns. ``keep_when_insufficient`` reads as a drop here: admission
    refills the batch group by group, so there is never a shortfall that keeping a rejected group would cover."""

    keep: bool
    reason: str | None = None
    keep_when_insufficient: bool = False


def is_slime_style(fn: Callable[..., Any], positional: int) -> bool:
    """True for ``fn(args, ...)`` taking at least ``positional`` positional parameters (slime's convention)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional_params = [p for p in params if p.kind in kinds]
    return bool(positional_params) and positional_params[0].name == "args" and len(positional_params) >= positional


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def accepted_kwargs(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keywords of ``kwargs`` that ``fn`` takes (all of them for ``**kwargs``): slime passes optional ones so."""
    params = inspect.signature(fn).parameters
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def adapt_generate(fn: Callable[..., Any], config: RunConfig, path: str) -> Callable[..., Any]:
    """Our ``generate(context, group)`` around a slime ``generate(args, sample, sampling_params)``.

    Each of the group's ``n_samples`` responses is one plugin call, run concurrently as slime does. A call may
    return one ``Sample`` or, as slime's multi-agent example does, a list of them (one per agent call): the list is
    that response's episode, a segment per sample (``to_wire_episode``). The plugin reaches the engine over HTTP,
    so it needs a server: refused at start-up with ``--rollout-engine torch``.
    """
    problem = http_engine_problem(config.engine.rollout_engine, f"--custom-generate-function-path {path}: a "
                                  "slime-style generate(args, sample, sampling_params)")
    if problem is not None:
        raise ValueError(problem)
    hooks = [load_object(p, what="--rollout-sample-hook-path") for p in config.rollout.rollout_sample_hook_path]
    namespaces: dict[str, Any] = {}

    async def generate(context: Any, group: PromptGroup) -> list[WireSample]:
        url = getattr(context.engine, "url", None)
        if url is None:
            raise RuntimeError(f"{path}: the rollout engine has no HTTP server for a slime-style generate plugin")
        args = namespaces.setdefault(url, build_args(config, server_url=url))
        take_back_memory = getattr(context.engine, "take_back_memory", None)
        if take_back_memory is not None:  # colocated: the server's memory, handed to the learner while it trained,
            await take_back_memory()  # comes back first (the plugin's own requests bypass the engine's generate)
        start = context.engine.version
        sampled_by = context.config_of(group)  # an eval group's: its set's own settings
        produced = await asyncio.gather(*(_one(args, group, index, start, sampled_by)
                                          for index in range(group.n_samples)))
        return [sample for episode in produced for sample in episode]

    async def _one(args: Any, group: PromptGroup, index: int, start: int, sampled_by: RunConfig
                   ) -> list[WireSample]:
        sample = from_group(group, index)
        extra = {"evaluation": group.is_eval}
        params = sampling_params(sampled_by, evaluation=group.is_eval)
        try:
            returned = _samples_of(await fn(args, sample, params, **accepted_kwargs(fn, extra)), path)
            hooked = [await _hooked(args, one, extra) for one in returned]
        except Exception as error:  # the user's code: its response fails, counted and logged; the worker goes on
            return [_failed(group, index, start, f"{path} raised {error!r}")]
        return to_wire_episode(hooked, group, index, start_version=start)

    async def _hooked(args: Any, sample: Any, extra: dict[str, Any]) -> Any:
        for hook in hooks:
            hooked = await _maybe_await(hook(args, sample, **accepted_kwargs(hook, {"rollout_id": None, **extra})))
            if hooked is not None:
                if not isinstance(hooked, Sample):
                    raise TypeError(f"--rollout-sample-hook-path {hook!r} returned {type(hooked).__name__}")
                sample = hooked
        return sample

    return generate


def _failed(group: PromptGroup, index: int, start: int, reason: str) -> WireSample:
    """Response `index` failed with `reason`: the buffer leaves it out of its group (or drops the group,
    `--failed-sample-policy`) and counts it. Raised instead, the group would be given out again and fail again, a
    lease timeout each time, for as long as the run lasts."""
    failed = from_group(group, index)
    failed.status = Sample.Status.FAILED
    return msgspec.structs.replace(to_wire(failed, group, index, start_version=start), error=reason)


def _samples_of(result: Any, path: str) -> list[Sample]:
    """What a slime generate call returned, as a list: one sample, or a multi-agent call's several."""
    listed = result if isinstance(result, list) else [result]
    strays = [type(sample).__name__ for sample in listed if not isinstance(sample, Sample)]
    if not listed or strays:
        what = (type(result).__name__ if not isinstance(result, list)
                else f"a list holding {strays[0]}" if strays else "an empty list")
        raise TypeError(f"{path} returned {what}; expected an actors.slime_compat.Sample or a non-empty list of "
                        "them (one episode: a sample per agent call)")
    return listed


def load_reward_post_process(config: RunConfig) -> BatchRewrite | None:
    """slime's ``--custom-reward-post-process-path`` as a step over a whole batch of wire samples, or None.

    slime calls it on the whole rollout batch in place of its own group normalisation and trains on the returned
    ``rewards``; so does the learner (the rewrite declares its rewards final). ``raw_rewards`` stay what the
    reward workers gave, which the batch's reward metrics already report.
    """
    path = config.reward.custom_reward_post_process_path
    if not path:
        return None
    fn = load_callable(path, what="--custom-reward-post-process-path")
    args = build_args(config)

    def post_process(samples: list[WireSample]) -> list[WireSample]:
        output = fn(args, [from_wire(s) for s in samples])
        if not (isinstance(output, tuple) and len(output) == 2 and len(output[1]) == len(samples)):
            raise TypeError(f"--custom-reward-post-process-path {path!r}: expected (raw_rewards, rewards) with one "
                            f"reward per sample ({len(samples)}), got {type(output).__name__}")
        return [msgspec.structs.replace(s, reward=float(r)) for s, r in zip(samples, output[1], strict=True)]

    return BatchRewrite(post_process, rewards_as_given=True)


def adapt_reward(fn: Callable[..., Any], config: RunConfig, *, group: bool) -> Callable[..., Any]:
    """A reward callable over our wire samples (one, or a group's list) around a slime ``rm(args, sample(s))``."""
    args = build_args(config)

    async def reward(samples: WireSample | list[WireSample]) -> Any:
        converted = [from_wire(s) for s in samples] if group else from_wire(samples)  # type: ignore[union-attr]
        return await _maybe_await(fn(args, converted))

    return reward


def load_slime_reward(config: RunConfig) -> Callable[..., Any] | None:
    """The adapted ``--custom-rm-path`` function when it is slime-style, else None (ours loads as before)."""
    path = config.reward.custom_rm_path
    if not path:
        return None
    fn = load_object(path, what="--custom-rm-path")
    if not callable(fn) or not is_slime_style(fn, 2):
        return None
    return adapt_reward(fn, config, group=config.reward.group_rm)


def adapt_filter(spec: str, config: RunConfig) -> Callable[[FilterGroup], FilterVerdict] | None:
    """Our filter around a slime dynamic-sampling filter ``(args, samples, **kw)``; None when ``spec`` is ours."""
    if "." not in spec and ":" not in spec:
        return None  # a built-in filter name
    fn = load_object(spec, what="--dynamic-sampling-filter-path")
    if not callable(fn) or not is_slime_style(fn, 2):
        return None
    args = build_args(config)

    def group_filter(group: FilterGroup) -> FilterVerdict:
        output = fn(args, [from_wire(s) for s in group.samples])
        if isinstance(output, bool):
            return FilterVerdict(keep=output)
        if not hasattr(output, "keep"):
            raise TypeError(f"{spec} returned {type(output).__name__}; expected DynamicFilterOutput or bool")
        return FilterVerdict(keep=bool(output.keep), reason=str(output.reason or ""))

    group_filter.__name__ = spec
    return group_filter
