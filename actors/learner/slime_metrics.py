"""The batch metrics slime adds under its logging switches, under slime's names, from our wire samples.

- `--log-multi-turn`: `multi_turn/raw_response_length/response_length_{mean,max,min,clip_ratio}` (every response
  token, environment output included; clipped: at --rollout-max-response-len), `multi_turn/wo_obs_response_length/
  response_length_{mean,max,min}` (the model's own tokens, loss mask 1), and `multi_turn/multi_turn_metric/
  round_number_{mean,max,min}`: a sample's `round_number` metadata where a generate function sets it (slime's
  rollout buffer does), else our multi-turn samples' `turns`.
- `--log-reward-category KEY`: `rollout/error_cat/VALUE`, the share of the batch's samples whose KEY is VALUE.
  KEY is a field of a dict reward (slime reads `sample.reward[KEY]`; here a dict reward's fields other than the
  reward travel as its extras) or, failing that, of the sample's metadata; a sample with neither counts in no share.
- `--log-correct-samples`: over the samples whose reward is 1 (slime's "correct"), `rollout/correct_length/p25 ..
  p100`, the share of them whose response length falls in each quarter of --rollout-max-response-len, and
  `rollout/correct_entropy`, the mean over them of each one's mean negative log-prob of its trained tokens (the
  engine's log-probs here: the learner's own are not kept per sample).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from actors.config.sections import LoggingConfig
from bus.schema import Sample
from policies.rewards import REWARD_EXTRAS


def slime_logging_metrics(samples: Sequence[Sample], logging: LoggingConfig, max_response_len: int
                          ) -> dict[str, float]:
    """Every family `logging` switches on, for one batch; empty when none is."""
    metrics: dict[str, float] = {}
    if logging.log_multi_turn:
        metrics |= multi_turn_metrics(samples, max_response_len)
    if logging.log_reward_category is not None:
        metrics |= reward_category_metrics(samples, logging.log_reward_category)
    if logging.log_correct_samples:
        metrics |= correct_sample_metrics(samples, max_response_len)
    return metrics


def _spread(prefix: str, values: np.ndarray) -> dict[str, float]:
    return {f"{prefix}_mean": float(values.mean()), f"{prefix}_max": float(values.max()),
            f"{prefix}_min": float(values.min())}


def _trained_tokens(sample: Sample) -> int:
    return int(np.sum(sample.loss_mask)) if sample.loss_mask is not None else sample.response_length


def multi_turn_metrics(samples: Sequence[Sample], max_response_len: int) -> dict[str, float]:
    if not samples:
        return {}
    raw = np.asarray([s.response_length for s in samples], dtype=np.float64)
    own = np.asarray([_trained_tokens(s) for s in samples], dtype=np.float64)
    metrics = {**_spread("multi_turn/raw_response_length/response_length", raw),
               "multi_turn/raw_response_length/response_length_clip_ratio": float(np.mean(raw >= max_response_len)),
               **_spread("multi_turn/wo_obs_response_length/response_length", own)}
    rounds = [_round_number(s) for s in samples]
    counted = np.asarray([r for r in rounds if r is not None], dtype=np.float64)
    if len(counted):
        metrics |= _spread("multi_turn/multi_turn_metric/round_number", counted)
    return metrics


def _round_number(sample: Sample) -> int | None:
    for key in ("round_number", "turns"):
        value = sample.metadata.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def reward_category_metrics(samples: Sequence[Sample], key: str) -> dict[str, float]:
    if not samples:
        return {}
    found = [_category(s, key) for s in samples]
    shares = Counter(str(value) for value in found if value is not None)
    return {f"rollout/error_cat/{value}": count / len(samples) for value, count in sorted(shares.items())}


def _category(sample: Sample, key: str) -> Any:
    extras = sample.metadata.get(REWARD_EXTRAS)
    if isinstance(extras, dict) and key in extras:
        return extras[key]
    return sample.metadata.get(key)


QUARTERS = (25, 50, 75, 100)


def correct_sample_metrics(samples: Sequence[Sample], max_response_len: int) -> dict[str, float]:
    correct = [s for s in samples if s.reward == 1]
    counts = [0] * len(QUARTERS)
    for sample in correct:  # a length past the cap (a generate function's own) counts in the last quarter
        quarter = next((i for i, p in enumerate(QUARTERS) if sample.response_length <= max_response_len * p / 100),
                       len(QUARTERS) - 1)
        counts[quarter] += 1
    metrics = {f"rollout/correct_length/p{p}": (count / len(correct) if correct else 0.0)
               for p, count in zip(QUARTERS, counts, strict=True)}
    entropies = [_mean_surprise(s) for s in correct]
    known = [value for value in entropies if value is not None]
    metrics["rollout/correct_entropy"] = float(np.mean(known)) if known else 0.0
    return metrics


def _mean_surprise(sample: Sample) -> float | None:
    """The mean of -log p over the sample's trained tokens; None without the engine's log-probs."""
    if sample.rollout_log_probs is None or not len(sample.rollout_log_probs):
        return None
    log_probs = np.asarray(sample.rollout_log_probs, dtype=np.float64)
    mask = (np.ones(len(log_probs), dtype=bool) if sample.loss_mask is None
            else np.asarray(sample.loss_mask, dtype=bool))
    if not mask.any():
        return None
    value = float(-log_probs[mask].mean())
    return value if math.isfinite(value) else None
