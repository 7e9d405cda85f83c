"""Pick the reward function from slime's flags: ``--rm-type``, ``--custom-rm-path``, ``--group-rm``, ``--rm-url``.

Precedence: ``custom_rm_path`` (a dotted path to the user's function) wins over ``rm_type``. With ``group_rm`` the
function is called once per prompt group with ``list[RewardInput]``; a built-in per-sample ``rm_type`` under
``group_rm`` is simply scored per sample (slime's group mode batches built-ins, it does not change them). As in
slime, ``boxed_<type>`` scores with ``<type>`` what the response's last ``\\boxed{}`` holds (an empty response
without one), so ``boxed_f1`` compares the boxed answer only.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bus.schema import Sample
from policies.registry import GROUP_REWARDS, resolve_group_reward, resolve_reward
from policies.rewards.inputs import reward_input
from policies.rewards.math_answers import extract_boxed
from policies.rewards.types import RewardInput

__all__ = ["BOXED_PREFIX", "RewardSpec", "boxed_only", "build_reward"]

REMOTE_RM_TYPE = "remote_rm"
BOXED_PREFIX = "boxed_"


@dataclass(frozen=True)
class RewardSpec:
    """The chosen function and how to run it: ``score_group`` when ``is_group``, else ``score``, each sample (an
    episode's final segment, with all its segments) given as ``argument_of`` makes it: a ``RewardInput`` for a
    function of ours; a loader that converts a function written to another convention picks what it reads."""

    name: str
    fn: Callable[..., Any]
    is_group: bool
    argument_of: Callable[[Sample, list[Sample]], Any] = reward_input


def build_reward(
    rm_type: str | None = None,
    *,
    custom_rm_path: str | None = None,
    group_rm: bool = False,
    rm_url: str | None = None,
    remote_timeout_s: float = 30.0,
    remote_max_retries: int = 3,
) -> RewardSpec:
    if custom_rm_path:
        if group_rm:
            return RewardSpec(name=custom_rm_path, fn=resolve_group_reward(custom_rm_path), is_group=True)
        return RewardSpec(name=custom_rm_path, fn=resolve_reward(custom_rm_path), is_group=False)
    if not rm_type:
        raise ValueError("reward: set rm_type (--rm-type) or custom_rm_path (--custom-rm-path)")
    if rm_type == REMOTE_RM_TYPE:
        if not rm_url:
            raise ValueError("rm_type='remote_rm' needs rm_url (--rm-url)")
        from policies.rewards.remote import RemoteRewardModel  # aiohttp: 0.11 s that only a remote model needs

        model = RemoteRewardModel(rm_url, timeout_s=remote_timeout_s, max_retries=remote_max_retries)
        return RewardSpec(name=rm_type, fn=model, is_group=False)
    if group_rm and rm_type in GROUP_REWARDS.names():
        return RewardSpec(name=rm_type, fn=resolve_group_reward(rm_type), is_group=True)
    if rm_type.startswith(BOXED_PREFIX) and rm_type.removeprefix(BOXED_PREFIX):
        return RewardSpec(name=rm_type, fn=boxed_only(resolve_reward(rm_type.removeprefix(BOXED_PREFIX))),
                          is_group=False)
    return RewardSpec(name=rm_type, fn=resolve_reward(rm_type), is_group=False)


def boxed_only(fn: Callable[[RewardInput], Any]) -> Callable[[RewardInput], Any]:
    """`fn` given the last boxed answer as the response (slime's ``boxed_`` rm types); sync or async as `fn` is,
    and called inline where `fn` is (`functools.wraps` carries its mark)."""

    def boxed(inp: RewardInput) -> RewardInput:
        return dataclasses.replace(inp, response=extract_boxed(inp.response) or "")

    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def scored_async(inp: RewardInput) -> Any:
            return await fn(boxed(inp))

        return scored_async

    @functools.wraps(fn)
    def scored(inp: RewardInput) -> Any:
        return fn(boxed(inp))

    return scored
