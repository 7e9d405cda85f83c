"""The one safe way to run reward functions: ``await score(fn, inputs)`` never raises.

A reward function that raises, returns NaN/inf, returns the wrong type, or exceeds ``timeout_s`` yields a
:class:`RewardOutcome` with ``status="error"`` and a reason (and the traceback, when it raised); a reward worker
keeps serving. Sync functions run in worker threads (``asyncio.to_thread``) so a slow sympy check does not stall
the worker's event loop; a timed-out thread cannot be killed and finishes in the background, its result discarded.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import math
import numbers
import os
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from policies.rewards.types import STEP_REWARDS, RewardInput, RewardOutcome

__all__ = ["graded_steps", "outcome_from_value", "runs_inline", "score", "score_group"]

# Frames a reward's traceback starts with that are ours or asyncio's, not the reward function's.
_RUNNER_FRAMES = (__file__, os.path.dirname(asyncio.__file__), os.path.dirname(concurrent.futures.__file__))


_INLINE = "slipstream_runs_inline"


def runs_inline(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a sync reward function as one that only looks at the text in linear time (no I/O, no solver): the
    runner then calls it on the event loop instead of in a thread under a timer. A thread hop and a timer cost
    ~100 us per sample, several times what such a function takes (measured: a third of the reward worker's CPU on
    the demo). A function marked so cannot be timed out, so a solver or a remote call must never be."""
    setattr(fn, _INLINE, True)
    return fn


async def score(
    fn: Callable[[RewardInput], Any],
    inputs: Sequence[RewardInput],
    *,
    timeout_s: float | None = None,
    max_concurrency: int | None = None,
    sync_in_thread: bool = True,
    key: str | None = None,
) -> list[RewardOutcome]:
    """Score each input with ``fn`` concurrently; outcomes are in input order. ``key``: see outcome_from_value."""
    convert = functools.partial(outcome_from_value, key=key)
    if getattr(fn, _INLINE, False) and not _is_async(fn):
        return [_inline(fn, inp, convert) for inp in inputs]
    limiter = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(inp: RewardInput) -> RewardOutcome:
        if limiter is None:
            return await _guarded(fn, inp, timeout_s, sync_in_thread, convert)
        async with limiter:
            return await _guarded(fn, inp, timeout_s, sync_in_thread, convert)

    return list(await asyncio.gather(*(one(inp) for inp in inputs)))


async def score_group(
    fn: Callable[[list[RewardInput]], Any],
    inputs: Sequence[RewardInput],
    *,
    timeout_s: float | None = None,
    sync_in_thread: bool = True,
    key: str | None = None,
) -> list[RewardOutcome]:
    """Score one group with a group reward function: one call, one outcome per input.

    If the call fails (raises, times out, wrong length) every sample gets the error; a single NaN entry only errors
    its own sample.
    """
    batch = list(inputs)

    def unpack(value: Any) -> list[RewardOutcome]:
        if isinstance(value, (str, bytes, dict)) or not isinstance(value, Sequence):
            return [RewardOutcome.error(f"group reward returned {type(value).__name__}, expected a list")] * len(batch)
        if len(value) != len(batch):
            return [RewardOutcome.error(f"group reward returned {len(value)} rewards for {len(batch)} samples")] * len(
                batch
            )
        return [outcome_from_value(v, key=key) for v in value]

    result = await _guarded(fn, batch, timeout_s, sync_in_thread, unpack)
    return result if isinstance(result, list) else [result] * len(batch)


def outcome_from_value(value: Any, *, key: str | None = None) -> RewardOutcome:
    """Normalise what a reward function returned: a real number, a bool, or a dict with a ``"reward"`` number.

    With ``key`` (slime's --reward-key) a dict's reward is read from that key instead: a function that returns
    several scores names the one to train on; a dict without it is an error naming the key and the dict's keys.
    """
    extras: dict[str, Any] = {}
    steps: tuple[tuple[int, float], ...] = ()
    if isinstance(value, dict):
        wanted = key or "reward"
        if wanted not in value:
            return RewardOutcome.error(f"returned a dict without {wanted!r} (keys: {sorted(map(str, value))})")
        extras = {k: v for k, v in value.items() if k not in (wanted, STEP_REWARDS)}
        if value.get(STEP_REWARDS) is not None:
            try:
                steps = graded_steps(value[STEP_REWARDS])
            except ValueError as error:
                return RewardOutcome.error(str(error))
        value = value[wanted]
    if isinstance(value, bool):
        value = float(value)
    if not isinstance(value, numbers.Real):
        return RewardOutcome.error(f"returned {type(value).__name__}, expected a number or a dict with 'reward'")
    reward = float(value)
    if not math.isfinite(reward):
        return RewardOutcome.error(f"returned non-finite reward {reward}")
    return RewardOutcome.ok(reward, extras, steps)


def graded_steps(value: Any) -> tuple[tuple[int, float], ...]:
    """A reward's `STEP_REWARDS` as ``((end, reward), ...)``; a ValueError saying what is wrong with it otherwise."""
    where = f"returned {STEP_REWARDS!r}"
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, Sequence):
        raise ValueError(f"{where} as {type(value).__name__}, expected a list of [end, reward] pairs")
    steps = []
    for index, pair in enumerate(value):
        if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise ValueError(f"{where}: step {index} is {pair!r}, expected [end, reward] (end: a character offset)")
        end, reward = pair
        if isinstance(end, bool) or not isinstance(end, numbers.Integral) or end < 1:
            raise ValueError(f"{where}: step {index} ends at {end!r}, expected a character offset >= 1")
        if isinstance(reward, bool):
            reward = float(reward)
        if not isinstance(reward, numbers.Real) or not math.isfinite(reward):
            raise ValueError(f"{where}: step {index} has reward {reward!r}, expected a finite number")
        if steps and end < steps[-1][0]:
            raise ValueError(f"{where}: step {index} ends at {end}, before step {index - 1} ({steps[-1][0]}): steps "
                             "come in the order of the response")
        steps.append((int(end), float(reward)))
    return tuple(steps)


async def _guarded(
    fn: Callable[[Any], Any],
    arg: Any,
    timeout_s: float | None,
    sync_in_thread: bool,
    convert: Callable[[Any], Any],
) -> Any:
    try:
        value = await asyncio.wait_for(_call(fn, arg, sync_in_thread), timeout=timeout_s)
    except asyncio.TimeoutError:
        return RewardOutcome.error(f"timed out after {timeout_s}s")
    except Exception as exc:  # the whole point: a reward bug marks the sample, never kills the worker
        return _raised(exc)
    return convert(value)


def _inline(fn: Callable[[Any], Any], arg: Any, convert: Callable[[Any], Any]) -> Any:
    try:
        value = fn(arg)
    except Exception as exc:
        return _raised(exc)
    return convert(value)


def _raised(exc: BaseException) -> RewardOutcome:
    return RewardOutcome.error(f"raised {type(exc).__name__}: {exc}", trace=_function_trace(exc))


async def _call(fn: Callable[[Any], Any], arg: Any, sync_in_thread: bool) -> Any:
    if _is_async(fn):
        return await fn(arg)
    value = await asyncio.to_thread(fn, arg) if sync_in_thread else fn(arg)
    if inspect.isawaitable(value):  # a sync wrapper that hands back a coroutine
        value = await value
    return value


def _function_trace(exc: BaseException) -> str:
    """The traceback from the reward function's first frame on (the runner and thread-pool frames dropped)."""
    frames = exc.__traceback__
    while frames is not None and frames.tb_next is not None and frames.tb_frame.f_code.co_filename.startswith(
            _RUNNER_FRAMES):
        frames = frames.tb_next
    return "".join(traceback.format_exception(type(exc), exc, frames))


def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004
