"""slime's ``--custom-convert-samples-to-train-data-path``: ``fn(args, samples) -> dict`` builds the training data.

slime's rollout manager calls it on the whole rollout batch in place of its own conversion, and so in place of its
reward post-process too: the rewards it returns are trained on as they are. The learner does the same on the wire
samples of a batch (:func:`load_convert_samples`, a rewrite that declares its rewards final). Of the dict it reads
``tokens`` (prompt + response), ``response_lengths``, ``loss_masks`` and ``rewards`` (all required, one entry per
sample, in the samples' order) and ``rollout_log_probs`` when given; the other keys slime's conversion writes
(``raw_reward``, ``truncated``, ``sample_indices``, ...) are accepted and not read.

A sample whose tokens the function changed gets the version of its oldest token for every token (the staleness it
reports can only err on the old side), and must come with ``rollout_log_probs``: the engine's log-probs of the old
tokens say nothing about new ones. An unchanged sample keeps its versions and, unless the dict gives new ones,
its log-probs.

slime accepts ``--custom-reward-post-process-path`` beside this hook and never calls it (the conversion replaces
the code that would); so does the learner. A convert function that wants it can load it from
``args.custom_reward_post_process_path`` itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec
import numpy as np

from actors.config import RunConfig
from actors.extensions.points import BatchRewrite
from actors.slime_compat.args import build_args
from actors.slime_compat.sample import from_wire
from bus.schema import Sample as WireSample
from policies.plugins import load_callable

__all__ = ["FLAG", "convert_samples", "load_convert_samples"]

FLAG = "--custom-convert-samples-to-train-data-path"
_REQUIRED = ("tokens", "response_lengths", "loss_masks", "rewards")


def load_convert_samples(config: RunConfig) -> BatchRewrite | None:
    """The configured convert function as a step over a whole batch of wire samples whose rewards are trained as
    given, or None."""
    path = config.learner.custom_convert_samples_to_train_data_path
    if not path:
        return None
    fn = load_callable(path, what=FLAG)
    args = build_args(config)

    def convert(samples: list[WireSample]) -> list[WireSample]:
        return convert_samples(fn, args, samples, path=path)

    return BatchRewrite(convert, rewards_as_given=True)


def convert_samples(fn: Callable[..., Any], args: Any, samples: Sequence[WireSample], *,
                    path: str) -> list[WireSample]:
    """The wire samples rebuilt from ``fn(args, slime_samples)``'s dict, one per input sample, in order."""
    data = fn(args, [from_wire(s) for s in samples])
    where = f"{FLAG} {path!r}"
    if not isinstance(data, Mapping):
        raise TypeError(f"{where}: expected a dict of per-sample lists, got {type(data).__name__}")
    for key in _REQUIRED:
        if key not in data:
            raise ValueError(f"{where}: the returned dict has no {key!r} (needs {', '.join(_REQUIRED)})")
    for key in (*_REQUIRED, "rollout_log_probs"):
        if key not in data or data[key] is None:
            continue
        if not hasattr(data[key], "__len__"):
            raise TypeError(f"{where}: {key!r} must be a list with one entry per sample, "
                            f"got {type(data[key]).__name__}")
        if len(data[key]) != len(samples):
            raise ValueError(f"{where}: {key!r} has {len(data[key])} entries for {len(samples)} input samples; "
                             "the learner needs exactly one per sample, in the samples' order")
    log_probs = data.get("rollout_log_probs")
    return [_rebuild(sample, data, index, None if log_probs is None else log_probs[index], where)
            for index, sample in enumerate(samples)]


def _rebuild(sample: WireSample, data: Mapping[str, Any], index: int, log_probs: Any, where: str) -> WireSample:
    at = f"{where}: sample {index} ({sample.sample_id})"
    tokens = _array(data["tokens"][index], f"{at}: tokens")
    if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"{at}: tokens must be integer token ids, got {tokens.dtype}")
    n = int(data["response_lengths"][index])
    if tokens.ndim != 1 or not 0 <= n <= len(tokens):
        raise ValueError(f"{at}: response_length {n} outside 0..len(tokens)={len(tokens)}")
    tokens = tokens.astype(np.int32)
    mask = _array(data["loss_masks"][index], f"{at}: loss_masks")
    if mask.shape != (n,):
        raise ValueError(f"{at}: loss_masks has shape {mask.shape} for response_length {n}")
    if not np.isin(mask, (0, 1)).all():
        raise ValueError(f"{at}: loss_masks must hold 0/1 per token, got values {sorted(set(mask.tolist()))[:5]}")
    reward = float(data["rewards"][index])
    if not math.isfinite(reward):
        raise ValueError(f"{at}: reward {reward} is not finite")
    changed = n != sample.response_length or not np.array_equal(tokens, sample.tokens)
    if log_probs is not None:
        rollout = _array(log_probs, f"{at}: rollout_log_probs").astype(np.float32)
        if rollout.shape != (n,):
            raise ValueError(f"{at}: rollout_log_probs has shape {rollout.shape} for response_length {n}")
    elif changed:
        raise ValueError(f"{at}: the function changed the sample's tokens (response_length {sample.response_length}"
                         f" -> {n}) but gave no rollout_log_probs for it; the engine's log-probs of the old tokens "
                         "do not describe the new ones")
    else:
        rollout = sample.rollout_log_probs
    return msgspec.structs.replace(
        sample, tokens=tokens, prompt_tokens=len(tokens) - n, response_length=n,
        response=sample.response if not changed else "", loss_mask=mask.astype(np.int8),
        rollout_log_probs=rollout, token_versions=_versions(sample, n) if changed else sample.token_versions,
        reward=reward,
    )


def _versions(sample: WireSample, n: int) -> np.ndarray | None:
    """Every token at the version of the sample's oldest token: conservative for the staleness bound."""
    if sample.token_versions is None or not len(sample.token_versions):
        return None
    return np.full(n, int(sample.token_versions.min()), dtype=np.int32)


def _array(value: Any, what: str) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor, on whatever device
        value = value.detach().cpu().numpy()
    try:
        return np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what}: not an array of numbers ({exc})") from exc
